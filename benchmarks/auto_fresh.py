""""auto" K from a fresh engine on a short run, against no-spec and every fixed K (issue 44's must-show 3).

    python benchmarks/auto_fresh.py [MODEL] --speculative-config '{"method": "mtp"}' --max-k 3 --batch 1 16 \
        --num-prompts 6 16 --max-tokens 96 --rounds 3 [--threads 1] [--json out.json]

Each round builds one fresh engine per config (no-spec, K = 1..max-k, "auto"; the build order rotates by round),
queues the same GSM8K test prompts on each (chat template, greedy, exactly --max-tokens each) and steps the engines
in turn, one step each, until all are done; a config's tok/s is its output tokens over the seconds of its own steps.
Taking turns step by step puts every config in the same seconds of the machine, whose speed drifts by 10-20%
between runs a minute apart (timed one after another, single engines differed by up to ~15%). "auto" starts from
its start-up profile alone every round, as a new user's engine does. Batch 1 runs its prompts one after another
(max_num_seqs 1), batch B > 1 all at once. Reported: each config's median tok/s over rounds, and "auto" over the
best fixed choice (the config of the best median): the ratio of medians, and paired within each round (the median
over rounds of the per-round ratio).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_MODEL
from tandem.bench.machine import describe, machine_info
from tandem.bench.prompts import prompt_texts


def run_round(model: str, configs: dict[str, dict | None], order: list[str], texts: list[str], batch: int,
              args: argparse.Namespace) -> dict[str, float]:
    """Output tokens/s of each config's fresh engine, the engines stepped in turn."""
    engines = {}
    try:
        for name in order:
            engines[name] = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=batch,
                                speculative_config=configs[name]).engine
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for engine in engines.values():
            for text in texts:
                engine.add_request(text, params)
        seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
        while any(engine.has_unfinished_requests() for engine in engines.values()):
            for name, engine in engines.items():
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    finished = engine.step()
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += sum(len(out.outputs[0].token_ids) for out in finished)
        return {name: tokens[name] / seconds[name] for name in engines}
    finally:
        for engine in engines.values():
            engine.shutdown()
        # an engine's objects refer to each other: without a collection here the last round's engines (~2 GB each
        # for SmolLM2) stayed alive beside the next round's, and six SmolLM2 engines at batch 32 were OOM-killed
        engines.clear()
        gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    p.add_argument("--speculative-config", type=json.loads, required=True, help="the drafter, without K")
    p.add_argument("--max-k", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prompts", type=int, nargs="+", default=[6, 16], help="one per --batch")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if len(args.num_prompts) != len(args.batch):
        p.error("--num-prompts takes one count per --batch")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info()
    print(describe(info))
    configs: dict[str, dict | None] = {"no-spec": None}
    configs |= {f"K={k}": args.speculative_config | {"num_speculative_tokens": k} for k in range(1, args.max_k + 1)}
    configs["auto"] = args.speculative_config | {"num_speculative_tokens": "auto",
                                                 "max_num_speculative_tokens": args.max_k}
    results = []
    for batch, n in zip(args.batch, args.num_prompts, strict=True):
        texts = prompt_texts("gsm8k", n)
        rates: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        for r in range(args.rounds):
            result = run_round(args.model, configs, names[r % len(names):] + names[:r % len(names)], texts, batch,
                               args)
            for name, rate in result.items():
                rates[name].append(rate)
        medians = {name: statistics.median(v) for name, v in rates.items()}
        best = max((name for name in names if name != "auto"), key=medians.__getitem__)
        paired = [rates["auto"][r] / rates[best][r] for r in range(args.rounds)]
        row = {"batch": batch, "num_prompts": n, "tokens_per_s": rates, "median_tokens_per_s": medians,
               "best_fixed": best, "auto_vs_best": medians["auto"] / medians[best],
               "auto_vs_best_paired": statistics.median(paired), "auto_vs_best_by_round": paired}
        results.append(row)
        print(f"batch {batch}, {n} prompts x {args.max_tokens} tokens, {args.rounds} rounds, median tok/s: "
              + ", ".join(f"{name} {v:.1f}" for name, v in medians.items())
              + f"; auto / best fixed ({best}): {row['auto_vs_best']:.3f}, paired by round "
              + f"{row['auto_vs_best_paired']:.3f} (" + ", ".join(f"{x:.3f}" for x in paired) + ")")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
