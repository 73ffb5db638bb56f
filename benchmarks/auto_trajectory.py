"""How "auto" K settles, batch by batch: one engine runs the same 5-shot GSM8K batch --runs times and prints, after
each, the K it chose at every step, its global acceptance and fill estimates per draft position, the mean acceptance
length so far and the exploration wait (explore_after). Shows what the end-of-run metrics hide: an estimate stuck
below the drafter's true acceptance, a wait doubling away, a first batch that decides the rest.

    python benchmarks/auto_trajectory.py [--drafter mtp] [--batch 1] [--runs 8]
"""

from __future__ import annotations

import argparse

import numpy as np
from spec_policy import STOP_STRINGS, drafter_spec, gsm8k_prompts

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_MODEL


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", choices=["mtp", "dspark", "ngram"], default="mtp")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--max-k", type=int, default=3)
    args = p.parse_args()
    texts = gsm8k_prompts(args.batch)
    params = SamplingParams(temperature=0, max_tokens=64, stop=STOP_STRINGS)
    llm = LLM(str(DEFAULT_MODEL), max_model_len=2048, speculative_config=drafter_spec(args.drafter, "auto", args.max_k),
              kv_cache_memory_bytes=2**28)
    try:
        policy = llm.engine.policy
        chosen: list[int] = []
        choose = policy.choose

        def recorded(running, new_batch=False):  # type: ignore[no-untyped-def]
            chosen.append(choose(running, new_batch))
            return chosen[-1]

        policy.choose = recorded  # type: ignore[method-assign]
        for run in range(args.runs):
            chosen.clear()
            llm.generate(texts, params, use_tqdm=False)
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
            length = metrics.get("tandem:spec_decode_mean_acceptance_length") or 0.0
            print(f"{run} K {''.join(map(str, chosen))}\n  acceptance {np.round(policy.accept.global_estimate(), 2)}"
                  f" fill {np.round(policy.fill.global_estimate(), 2)} mean acceptance length {length:.2f}"
                  f" explore_after {policy.explore_after}")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
