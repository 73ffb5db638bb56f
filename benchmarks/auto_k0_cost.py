"""What a K = 0 step of an "auto" engine costs beside a no-spec engine's: MTP and DSpark "auto" engines whose policy
is forced to choose K = 0, no-spec, and a free MTP "auto", on 5-shot GSM8K (greedy, 64 tokens, EOS ignored),
alternating, best of --repeats; then where each K = 0 step's time goes (benchmarks/step_profile.py's wrappers).
With --paired, engines forced to K = 0 with and without the policy's record_step (what "auto" pays for learning
while it runs K = 0) beside no-spec and a no-spec twin (the noise yardstick), steps interleaved in turns of 8 as in
benchmarks/spec_policy.py, and each engine's median over rounds of its tok/s over no-spec's in the same round.

    python benchmarks/auto_k0_cost.py [--batch 8] [--repeats 4] [--paired]

A K = 0 step of MTP "auto" defers the drafter's step 0 (mtp_catch_up.py) and DSpark's its context write: both keep a
few tensors per step, which this measures against a plain decode.
"""

from __future__ import annotations

import argparse
import statistics
import time

import step_profile
from spec_policy import interleaved_round

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL
from tandem.data.gsm8k import SHARED_GSM8K
from tandem.engine.spec_policy import SpecPolicy
from tandem.eval.gsm8k import build_prompts, load_eval_data

AUTO = {"num_speculative_tokens": "auto", "max_num_speculative_tokens": 3}


def workload(batch: int) -> tuple[list[str], SamplingParams]:
    """5-shot GSM8K prompts (seed 42) and greedy 64-token params, EOS ignored: every step a full-batch decode."""
    questions, shots = load_eval_data(str(SHARED_GSM8K / "test.jsonl"), None, batch, 5, seed=42)[:2]
    return build_prompts(questions, shots), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def force_k0(policy: SpecPolicy) -> None:
    """The policy answers K = 0 at every step (its bookkeeping of chosen K kept)."""
    policy.choose = lambda running, new_batch=False: policy._commit(0, 0.0)  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--paired", action="store_true", help="K = 0 with and without record_step, paired rounds")
    args = p.parse_args()
    if args.paired:
        paired(args)
        return
    prompts, params = workload(args.batch)
    configs = {"no-spec": None, "mtp-auto-k0": {"method": "mtp", **AUTO},
               "dspark-auto-k0": {"method": "dspark", "model": str(DEFAULT_DSPARK), **AUTO},
               "mtp-auto": {"method": "mtp", **AUTO}}
    engines = {name: LLM(str(DEFAULT_MODEL), max_model_len=4096, speculative_config=spec)
               for name, spec in configs.items()}
    try:
        for name, llm in engines.items():
            llm.generate(prompts, params, use_tqdm=False)  # warm-up: prefix cache, the policy's first fits
            if name.endswith("-k0"):
                force_k0(llm.engine.policy)
        best = dict.fromkeys(engines, float("inf"))
        for _ in range(args.repeats):
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best[name] = min(best[name], time.perf_counter() - start)
        print("tok/s:", {name: round(64 * args.batch / wall, 1) for name, wall in best.items()})
        for name in ("no-spec", "mtp-auto-k0", "dspark-auto-k0"):
            step_profile.instrument(engines[name])
            step_profile.TOTALS.clear()
            engines[name].generate(prompts, params, use_tqdm=False)
            step = step_profile.TOTALS.pop("step", 0.0)
            parts = {part: round(s / 64 * 1000, 2) for part, s in step_profile.TOTALS.items()}
            print(f"{name}: ms a step {step / 64 * 1000:.2f}, of which {parts}")
    finally:
        for llm in engines.values():
            llm.shutdown()


def paired(args: argparse.Namespace) -> None:
    prompts, params = workload(args.batch)
    drafters = {"mtp": {"method": "mtp", **AUTO}, "dspark": {"method": "dspark", "model": str(DEFAULT_DSPARK), **AUTO}}
    configs = {"no-spec": None, **{f"{d}-auto-k0{suffix}": spec for d, spec in drafters.items()
                                   for suffix in ("", "-norecord")}, "twin": None}
    engines = {name: LLM(str(DEFAULT_MODEL), max_model_len=4096, speculative_config=spec)
               for name, spec in configs.items()}
    try:
        for name, llm in engines.items():
            llm.generate(prompts, params, use_tqdm=False)  # warm-up: prefix cache, the policy's first fits
            policy = llm.engine.policy
            if policy is not None:
                force_k0(policy)
                if name.endswith("-norecord"):
                    policy.record_step = lambda *a, **kw: None
        rounds: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, (wall, tokens) in interleaved_round(engines, prompts, params, 8).items():
                rounds[name].append(tokens / wall)
        for name, tps in rounds.items():
            ratio = statistics.median(a / b for a, b in zip(tps, rounds["no-spec"], strict=True))
            print(f"{name:>24}: best {max(tps):7.1f} tok/s, paired median over no-spec {ratio:.3f}")
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
