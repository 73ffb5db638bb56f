"""`tandem bench profile`: where a step's wall time goes, per batch size: model forward, metadata (inputs, PCP
partition), scheduling, sampling / verification, drafting and output processing; "other" is the rest of
`LLMEngine.step`. Single rank, greedy, EOS ignored, every prompt exactly `max_tokens` tokens.

Each part is timed by wrapping the function that does it (perf_counter around the call, ~1 us a call) for the timed
`generate` only, after a warm-up; the wrappers come off afterwards. A function one wrapper times is never called
inside another's, so the parts and "other" add up to the step time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from tandem.bench.machine import describe, machine_info
from tandem.bench.prompts import bench_prompts
from tandem.entrypoints.engine_args import EngineArgs

PARTS = ("forward", "metadata", "scheduling", "sampling", "drafting", "output processing")
WARMUP_PROMPTS, WARMUP_TOKENS = 2, 4


class StepTimer:
    """Seconds per part, summed over every call while installed; `totals["step"]` is LLMEngine.step's own."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[part] += time.perf_counter() - start

        return wrapper

    def instrument(self, llm: Any) -> list[Callable[[], None]]:
        """Wraps the engine's parts in place; returns the undo of each wrap."""
        import tandem.runner.model_runner as model_runner

        engine = llm.engine
        runner = getattr(engine.executor, "runner", None)
        if runner is None:
            raise ValueError("tandem bench profile times one rank in this process: -tp and -pcp must be 1")
        targets: list[tuple[Any, str, str]] = [
            (engine.scheduler, "schedule", "scheduling"), (engine.scheduler, "update", "scheduling"),
            (engine, "step", "step"), (model_runner, "prepare_inputs", "metadata"),
            (runner.pcp, "maybe_partition", "metadata"), (runner.model, "forward", "forward"),
            (runner, "_verify_or_sample", "sampling"), (runner.proposer, "observe", "drafting"),
            (runner.proposer, "propose", "drafting"), (engine.outputs, "append", "output processing"),
            (engine.outputs, "make_output", "output processing")]
        return [self._wrap(owner, name, part) for owner, name, part in targets]

    def _wrap(self, owner: Any, name: str, part: str) -> Callable[[], None]:
        own = name in vars(owner)  # a module's function or an instance's attribute, else a class's method
        original = getattr(owner, name)
        setattr(owner, name, self.timed(part, original))
        return (lambda: setattr(owner, name, original)) if own else (lambda: delattr(owner, name))

    @contextmanager
    def installed(self, llm: Any) -> Iterator[StepTimer]:
        undo = self.instrument(llm)
        try:
            yield self
        finally:
            for fn in reversed(undo):
                fn()


def profile_batch(engine_args: EngineArgs, batch: int, max_tokens: int) -> dict[str, Any]:
    """One engine, one timed generate of `batch` GSM8K questions; seconds and share of the step per part."""
    from tandem import LLM, SamplingParams

    llm = LLM(**vars(engine_args))
    try:
        prompts = bench_prompts(batch)
        llm.generate(prompts[:WARMUP_PROMPTS], SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS),
                     use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        with StepTimer().installed(llm) as timer:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    step = timer.totals.pop("step")
    seconds = {part: timer.totals.get(part, 0.0) for part in PARTS}
    seconds["other"] = step - sum(seconds.values())
    return {"batch_size": batch, "wall_s": wall, "step_s": step, "output_tokens_per_s": batch * max_tokens / wall,
            "seconds": seconds, "share": {part: s / step for part, s in seconds.items()}}


def run_profile(engine_args: EngineArgs, batch_sizes: list[int], max_tokens: int) -> dict[str, Any]:
    info = machine_info()
    print(describe(info))
    # Each batch size on a fresh engine: a prompt cached by an earlier size would skip its prefill.
    rows = [profile_batch(replace(engine_args), b, max_tokens) for b in batch_sizes]
    cfg = {"batch_sizes": batch_sizes, "max_tokens": max_tokens,
           "engine_args": {k: v for k, v in vars(engine_args).items() if k != "extra"}}
    return {"machine": info, "config": cfg, "results": rows}


def report(result: dict[str, Any]) -> str:
    parts = (*PARTS, "other")
    lines = ["| batch | tok/s | step s | " + " | ".join(parts) + " |", "|---|---|---|" + "---|" * len(parts)]
    for r in result["results"]:
        lines.append(f"| {r['batch_size']} | {r['output_tokens_per_s']:.1f} | {r['step_s']:.3f} | "
                     + " | ".join(f"{100 * r['share'][p]:.1f}%" for p in parts) + " |")
    lines.append("shares of LLMEngine.step's wall time, summed over the timed generate's steps (step s)")
    return "\n".join(lines)
