"""Where a step's wall time goes: model forward vs metadata (inputs + attention metadata), scheduling, sampling /
verification, drafting and output processing, at batch 1 and batch 32, greedy, single rank.

    python benchmarks/step_profile.py [--model PATH] [--dtype float32] [--max-tokens 64] [--batches 1 32]
        [--compilation-mode 0|3] [--spec '{"method": "mtp", "num_speculative_tokens": 3}'] [--json out.json]

Each part is timed by wrapping the function that does it (perf_counter around the call; the wrappers cost ~1 us a
call); "other" is the rest of LLMEngine.step. Works on this tree and on the seed's runner (the wrapped names exist
in both), so one command measures before and after: run it from a checkout of each.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_MODEL
from tandem.data.gsm8k import SHARED_GSM8K
from tandem.eval.gsm8k import build_prompts, load_eval_data

TOTALS: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start

    return wrapper


def instrument(llm: LLM) -> None:
    import tandem.worker.model_runner as mr

    engine = llm.engine
    runner = engine.executor.runner
    engine.scheduler.schedule = timed("scheduling", engine.scheduler.schedule)
    engine.scheduler.update = timed("scheduling", engine.scheduler.update)
    engine.step = timed("step", engine.step)
    mr.prepare_inputs = timed("metadata", mr.prepare_inputs)
    runner.pcp.maybe_partition = timed("metadata", runner.pcp.maybe_partition)
    runner.model.forward = timed("forward", runner.model.forward)
    runner._verify_or_sample = timed("sampling", runner._verify_or_sample)
    proposer = getattr(runner, "proposer", None)
    for name in ("observe", "propose"):
        if proposer is not None and hasattr(proposer, name):
            setattr(proposer, name, timed("drafting", getattr(proposer, name)))
    outputs = getattr(engine, "outputs", None)  # this tree: OutputProcessor; the seed: methods of the engine
    for owner, names in ((outputs, ("append", "make_output")), (engine, ("_append_token", "_output"))):
        for name in names:
            if owner is not None and hasattr(owner, name):
                setattr(owner, name, timed("output processing", getattr(owner, name)))


def profile(args: argparse.Namespace, batch: int) -> dict[str, float]:
    spec = json.loads(args.spec) if args.spec else None
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, speculative_config=spec,
              compilation_config={"mode": args.compilation_mode} if args.compilation_mode else None)
    data = str(SHARED_GSM8K / "test.jsonl") if (SHARED_GSM8K / "test.jsonl").is_file() else "synthetic"
    questions, shots = load_eval_data(data, None, batch, 0, seed=42)[:2]  # (a third item: the pool name)
    prompts = build_prompts(questions, shots)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    instrument(llm)
    TOTALS.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.shutdown()
    step = TOTALS.pop("step")
    parts = dict(TOTALS) | {"other": step - sum(TOTALS.values())}
    return {"batch": batch, "wall_s": wall, "tokens_per_s": batch * args.max_tokens / wall,
            "share": {k: v / step for k, v in parts.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--compilation-mode", type=int, default=0)
    p.add_argument("--spec", default=None)
    p.add_argument("--json")
    args = p.parse_args()
    results = [profile(args, b) for b in args.batches]
    parts = ["forward", "metadata", "scheduling", "sampling", "drafting", "output processing", "other"]
    print("| batch | tok/s | " + " | ".join(parts) + " |")
    print("|---|---|" + "---|" * len(parts))
    for r in results:
        print(f"| {r['batch']} | {r['tokens_per_s']:.1f} | "
              + " | ".join(f"{100 * r['share'].get(k, 0.0):.1f}%" for k in parts) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
