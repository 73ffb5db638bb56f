"""The "auto" K policy (engine/spec_policy.py). On seeded random synthetic engines (step costs per batch and K,
per-position acceptance, timing noise, a served step's overhead the start-up profile does not see) its tokens per
second stay within a few percent of the best fixed K, it stops drafting when drafting stops paying and starts again
when it pays; "auto" is validated with clear errors; greedy output with "auto" equals no speculation on every tiny
architecture, PCP 1 and 2, both draft modes, with K forced to vary."""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from checkpoints import ARCHS
from dspark_checkpoint import build_dspark_drafter
from engine_utils import random_prompts, record_steps

from tandem import LLM, SamplingParams
from tandem.config import ConfigError, ModelConfig, SpeculativeConfig
from tandem.engine.spec_policy import SpecPolicy
from tandem.step_plan import RowSampling, ScheduledRow, StepOutput, StepPlan

GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)
K_MAX = 4
MTP_ARCHS = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
PROFILED_ROWS = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class World:
    """A synthetic engine. A step of B decode rows that verify d drafts each and propose K costs
    base + per_token B (1 + d) + [K > 0] (draft_base + per_draft K)(1 + draft_per_row B) seconds (target, then
    drafter); draft j of a row is accepted with probability accept[j - 1] once the drafts before it were."""

    accept: list[float]
    base: float = 0.010
    per_token: float = 0.001
    draft_base: float = 0.0005
    per_draft: float = 0.002
    draft_per_row: float = 0.02
    overhead: float = 0.0  # what a served step adds that the profile's executor steps do not see

    def seconds(self, rows: int, verified: int, k: int) -> float:
        draft = (self.draft_base + self.per_draft * k) * (1 + self.draft_per_row * rows) if k else 0.0
        return self.base + self.per_token * rows * (1 + verified) + draft

    def expected_rate(self, rows: int, k: int) -> float:
        emitted, run = 1.0, 1.0
        for a in self.accept[:k]:
            run *= a
            emitted += run
        return rows * emitted / self.seconds(rows, k, k)

    def profile(self, rng: random.Random, noise: float = 0.05) -> tuple[list[int], list[list[float]]]:
        return PROFILED_ROWS, [[self.seconds(r, k, k) * (1 + noise * (2 * rng.random() - 1)) for k in
                                range(K_MAX + 1)] for r in PROFILED_ROWS]


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    ks: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def simulate(choose, world: World | list[tuple[int, World]], rows: int, steps: int, seed: int,
             policy: SpecPolicy | None = None) -> Run:
    """`steps` engine steps of `rows` decode rows; `choose()` gives each step's K (verifying the drafts the last
    step proposed, at most K). A list of (steps, world) phases changes the world as the run goes. 5% timing noise."""
    phases = world if isinstance(world, list) else [(steps, world)]
    rng, run, pending = random.Random(seed), Run(), 0
    for count, w in phases:
        for _ in range(count):
            k = choose()
            d = min(pending, k)
            emitted = []
            for _ in range(rows):
                hits = 0
                while hits < d and rng.random() < w.accept[hits]:
                    hits += 1
                emitted.append([0] * (hits + 1))
            seconds = w.seconds(rows, d, k) * (1 + 0.05 * (2 * rng.random() - 1)) + w.overhead
            if policy is not None:
                plan = StepPlan([ScheduledRow(f"r{i}", [0] * (1 + d), 100, [], False, GREEDY, num_draft_tokens=d)
                                 for i in range(rows)], num_spec_tokens=k)
                policy.record_step(plan, StepOutput(emitted, [None] * rows, [[0] * k] * rows), seconds)
            run.tokens += sum(map(len, emitted))
            run.seconds += seconds
            run.ks.append(k)
            pending = k
    return run


def auto_vs_fixed(world, rows: int, steps: int, seed: int) -> tuple[Run, dict[int, Run]]:
    first = world[0][1] if isinstance(world, list) else world
    policy = SpecPolicy(K_MAX)
    policy.set_costs(*first.profile(random.Random(seed)))
    auto = simulate(lambda: policy.choose(rows), world, rows, steps, seed, policy)
    fixed = {k: simulate(lambda k=k: k, world, rows, steps, seed) for k in range(K_MAX + 1)}
    return auto, fixed


def random_world(rng: random.Random) -> World:
    a = rng.uniform(0.05, 0.95)
    return World([min(a * rng.uniform(0.85, 1.1), 0.98) for _ in range(K_MAX)], base=rng.uniform(0.004, 0.03),
                 per_token=rng.uniform(0.0002, 0.003), draft_base=rng.uniform(0.0, 0.002),
                 per_draft=rng.uniform(0.0003, 0.006), draft_per_row=rng.uniform(0.0, 0.05),
                 overhead=rng.uniform(0.0, 0.003))


@pytest.mark.parametrize("seed", range(100))
def test_auto_is_close_to_the_best_fixed_k_on_random_engines(seed):
    """Whatever the costs and the acceptance, over 300 steps "auto" emits at least 0.95x the tokens per second of
    the best fixed K (no-spec included), learning acceptance from scratch and the served step's overhead."""
    rng = random.Random(seed)
    world, rows = random_world(rng), rng.choice([1, 3, 8, 16, 40, 64, 100])
    auto, fixed = auto_vs_fixed(world, rows, 300, seed)
    best = max(fixed, key=lambda k: fixed[k].rate)
    assert auto.rate >= 0.95 * fixed[best].rate, (
        f"{world} at {rows} rows: auto {auto.rate:.1f} tok/s, best fixed K={best} {fixed[best].rate:.1f} "
        f"({ {k: round(r.rate, 1) for k, r in fixed.items()} }); auto chose {auto.ks[::10]}")


@pytest.mark.parametrize("rows", [1, 16])
def test_short_runs_lose_little_while_acceptance_is_learnt(rows):
    """From a fresh policy on 96 steps (a short run), where one clear K is best: within 0.93x of it."""
    for world in (World([0.9] * K_MAX, per_draft=0.0005), World([0.1] * K_MAX), World([0.6] * K_MAX)):
        auto, fixed = auto_vs_fixed(world, rows, 96, 7)
        best = max(fixed, key=lambda k: fixed[k].rate)
        assert auto.rate >= 0.93 * fixed[best].rate, f"{world}: auto {auto.ks} vs best fixed K={best}"


def test_stops_drafting_when_it_stops_paying_and_drafts_again_when_it_pays():
    """Acceptance collapses for 300 steps, then recovers: "auto" runs mostly at K = 0 by the last third of the
    collapse (batch 1: one verified row a step, and explorations), drafts again after it (an estimate at K = 0 is
    refreshed only by exploring), and keeps within 0.97x of every fixed K over the run."""
    good, bad = World([0.85] * K_MAX, per_draft=0.001), World([0.02] * K_MAX, per_draft=0.001)
    assert good.expected_rate(1, 3) > 1.5 * good.expected_rate(1, 0)
    assert bad.expected_rate(1, 1) < bad.expected_rate(1, 0)
    auto, fixed = auto_vs_fixed([(200, good), (300, bad), (300, good)], 1, 800, 3)
    ks = auto.ks
    assert sum(k == 0 for k in ks[400:500]) >= 50, f"kept drafting through the collapse: {ks[200:500]}"
    assert sum(k >= 2 for k in ks[700:]) >= 90, f"did not draft again after it: {ks[500:]}"
    assert auto.rate >= 0.97 * max(r.rate for r in fixed.values()), "adapting should keep up with every fixed K"


def test_k_varies_with_the_batch_where_verification_is_compute():
    """A cheap drafter whose verification tokens cost more per row than drafting saves at a large batch: "auto"
    drafts at K_max for one row and less (or not at all) at 64 rows, each as the best fixed K does."""
    world = World([0.7] * K_MAX, base=0.01, per_token=0.002, per_draft=0.0005)
    for rows in (1, 64):
        auto, fixed = auto_vs_fixed(world, rows, 300, 5)
        best = max(fixed, key=lambda k: fixed[k].rate)
        mode = max(set(auto.ks[50:]), key=auto.ks[50:].count)
        assert abs(mode - best) <= 1, f"{rows} rows: auto settled at K={mode}, the best fixed K is {best}"
    assert max(fixed, key=lambda k: fixed[k].rate) < K_MAX


def test_without_a_profile_served_steps_teach_the_costs():
    """With no room to profile (the nominal table), the scales learn the costs of the Ks it runs: still within
    0.9x of the best fixed K over 400 steps."""
    world = World([0.8] * K_MAX, per_draft=0.001)
    policy = SpecPolicy(K_MAX)
    auto = simulate(lambda: policy.choose(4), world, 4, 400, 11, policy)
    fixed = {k: simulate(lambda k=k: k, world, 4, 400, 11) for k in range(K_MAX + 1)}
    assert auto.rate >= 0.9 * max(r.rate for r in fixed.values()), auto.ks[::10]


def test_a_drifting_machine_speed_does_not_hold_k_at_another_minutes_price():
    """The machine's speed drifts (a VM: 20-40% between minutes): every 25 steps all costs scale by a factor in
    0.7-1.4. "auto" stays within 0.92x of the best fixed K, whether the best K is deep, 1 or none: a K priced in a slow
    minute must not look dear in a fast one, nor one priced in a fast minute cheap in a slow one."""
    def scaled(w: World, f: float) -> World:  # every cost in seconds times f (draft_per_row is a ratio)
        return dataclasses.replace(w, base=w.base * f, per_token=w.per_token * f, draft_base=w.draft_base * f,
                                   per_draft=w.per_draft * f, overhead=w.overhead * f)

    for world in (World([0.85] * K_MAX, per_draft=0.0005), World([0.6] * K_MAX, per_draft=0.003),
                  World([0.3] * K_MAX, per_draft=0.004)):
        for rows in (1, 16):
            for seed in range(6):
                rng = random.Random(seed)
                phases = [(25, scaled(world, 1.0 if i == 0 else rng.uniform(0.7, 1.4))) for i in range(12)]
                auto, fixed = auto_vs_fixed(phases, rows, 300, seed)
                best = max(fixed, key=lambda k: fixed[k].rate)
                assert auto.rate >= 0.92 * fixed[best].rate, (
                    f"{world} at {rows} rows, seed {seed}: auto {auto.rate:.1f} tok/s, best fixed K={best} "
                    f"{fixed[best].rate:.1f}; auto chose {auto.ks[::5]}")


def test_a_stall_moves_the_prices_little():
    """One step 50x its usual time (a GC pause, another process) must not move K to a clearly worse one."""
    world = World([0.9] * K_MAX, per_draft=0.0005)
    policy = SpecPolicy(K_MAX)
    policy.set_costs(*world.profile(random.Random(0), noise=0.0))
    simulate(lambda: policy.choose(1), world, 1, 60, 0, policy)
    k = policy.k
    assert k >= 2
    plan = StepPlan([ScheduledRow("r", [0] * (1 + k), 100, [], False, GREEDY, num_draft_tokens=k)], num_spec_tokens=k)
    policy.record_step(plan, StepOutput([[0] * (k + 1)], [None], [[0] * k]), 50 * world.seconds(1, k, k))
    after = policy.choose(1)
    assert world.expected_rate(1, after) >= 0.97 * world.expected_rate(1, k), (k, after)


def _model() -> ModelConfig:
    from types import SimpleNamespace

    return ModelConfig("m", SimpleNamespace(num_nextn_predict_layers=1), "DeepseekV3ForCausalLM", None, 64)


@pytest.mark.parametrize("spec,message", [
    ({"num_speculative_tokens": "auto"}, "speculative_config.max_num_speculative_tokens=0 is not allowed"),
    ({"num_speculative_tokens": "auto", "max_num_speculative_tokens": 99}, "an integer from 1 to 16"),
    ({"num_speculative_tokens": "fast"}, "speculative_config.num_speculative_tokens='fast' is not allowed"),
    ({"num_speculative_tokens": 2, "max_num_speculative_tokens": 4}, 'only with num_speculative_tokens "auto"'),
    ({"num_speculative_tokens": "auto", "max_num_speculative_tokens": 3,
      "num_speculative_tokens_per_batch_size": ((4, 2),)}, "num_speculative_tokens_per_batch_size"),
])
def test_invalid_auto_configs_name_the_field(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SpeculativeConfig(method="mtp", **spec).validate(_model())


def test_auto_config_sizes_everything_by_its_maximum():
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens="auto", max_num_speculative_tokens=3)
    spec.validate(_model())
    assert spec.auto and spec.max_num_speculative_tokens == 3 and spec.num_lookahead_slots == 3


# -- losslessness: greedy output with "auto" equals no speculation -------------------------------------------------
ENGINE_LENGTHS = [4, 9, 17, 30, 45, 70]  # several exceed the 32-token budget, so PCP segments start mid-prompt
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
ENGINE_GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
AUTO = {"num_speculative_tokens": "auto", "max_num_speculative_tokens": 3}
SHARDED_OR_REPLICATED = {"deepseek_v3": {"sharded": "PAGED_MLA", "replicated": "CONTIGUOUS_MLA"},
                         "glm4_moe": {"sharded": "PAGED_SDPA", "replicated": "CONTIGUOUS_SDPA"}}
# (arch, PCP size, drafter, draft mode): every tiny architecture at PCP 1, MTP in both draft modes at PCP 2,
# DSpark (always replicated) at PCP 2
LOSSLESS = [(arch, 1, "mtp" if arch in MTP_ARCHS else "ngram", None) for arch in ARCHS] + [
    ("deepseek_v3", 2, "mtp", "sharded"), ("deepseek_v3", 2, "mtp", "replicated"),
    ("glm4_moe", 2, "mtp", "sharded"), ("glm4_moe", 2, "mtp", "replicated"),
    ("glm4_moe", 2, "dspark", "replicated"), ("glm4_moe", 1, "dspark", None),  # PCP 1: K = 0 defers its context
]


def _engine_prompts() -> list[list[int]]:
    prompts = random_prompts(ENGINE_LENGTHS, vocab_size=500, seed=31)
    prompts[2] = [7, 8, 9, 10] * 4 + [7]  # repetitive, so n-gram drafts get accepted now and then
    return prompts


def _engine_run(path: Path, **kwargs) -> tuple[list[list[int]], dict, str | None]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _engine_prompts()], ENGINE_GREEDY, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        return [o.outputs[0].token_ids for o in outs], metrics, llm.draft_mode
    finally:
        llm.shutdown()


@functools.lru_cache(maxsize=8)
def _no_spec(path: Path) -> list[list[int]]:
    return _engine_run(path)[0]


class _Restless(SpecPolicy):
    """The policy, exploring after 2 steps at K = 0 and overruled every third step by each K in turn (1, 2, ...,
    K_max, 0), so that on tiny models (where one K may win throughout, and which one depends on the measured step
    times) every run still switches K: up, down and to 0. The first step is overruled
    too: the prompts that end in it propose drafts whatever the timings (n-gram's repetitive prompt then drafts at
    once; left to the timings, a run under load could end without a single draft). The step after an overruled
    K > 0 drafts too (K = 1 where the policy chose 0), so those drafts are verified, not all dropped (a run on a
    loaded machine chose 0 throughout and verified none: [1, 0, 0, 2, 0, 0, 3, ...])."""

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.explore_after = 2
        self.ks: list[int] = []

    def choose(self, num_rows: int) -> int:
        k = super().choose(num_rows)
        if k == 0:
            self.explore_after = 2
        if len(self.ks) % 3 == 0:  # every K in turn, 0 included, whatever the timed choice
            k = (len(self.ks) // 3 + 1) % (self.max_k + 1)
        elif len(self.ks) % 3 == 1 and self.ks[-1] > 0 and k == 0:
            # the drafts a K > 0 step proposes are verified only by a next step that drafts too: where the timed
            # choice stays at 0 (a loaded machine), a perturbed step alone would leave every draft dropped
            k = 1
        self.ks.append(k)
        return k


@pytest.mark.parametrize("arch,pcp,method,mode", LOSSLESS)
def test_auto_greedy_equals_no_speculation(tiny_checkpoints, tmp_path, monkeypatch, arch, pcp, method, mode):
    """K changes between steps, drafts pending from a larger K are dropped, and K = 0 steps still keep MTP's and
    DSpark's own KV current: none of it may change a token."""
    policies: list[_Restless] = []
    monkeypatch.setattr("tandem.engine.llm_engine.SpecPolicy",
                        lambda k: policies.append(_Restless(k)) or policies[-1])
    path = tiny_checkpoints(arch, num_mtp_layers=1 if method == "mtp" else 0)
    spec: dict = {"method": method, **AUTO}
    if method == "mtp" and mode is not None:
        spec["attention_backend"] = SHARDED_OR_REPLICATED[arch][mode]
    if method == "dspark":
        bigrams = {}
        for prompt, out in zip(_engine_prompts(), _no_spec(path), strict=True):
            seq = prompt[-1:] + out
            bigrams.update({a: b for a, b in zip(seq, seq[1:], strict=False) if a not in bigrams})
        spec["model"] = str(build_dspark_drafter(path, tmp_path / "dspark", bigrams=bigrams, boost=20.0))
    tokens, m, draft_mode = _engine_run(path, speculative_config=spec, prefill_context_parallel_size=pcp)
    assert mode is None or draft_mode == mode
    ks = policies[0].ks
    assert m["tandem:spec_decode_num_drafts"] > 0 and 0 in ks and len(set(ks)) >= 3, f"K did not vary: {ks}"
    for i, (got, want) in enumerate(zip(tokens, _no_spec(path), strict=True)):
        assert got == want, f"{arch} PCP={pcp} {method} {mode}: prompt {i} differs from no speculation"


class _Scripted(SpecPolicy):
    """The policy with its K taken from a fixed schedule, whatever the timings: two engines see the same steps."""

    SCHEDULE = (2, 0, 0, 1, 0, 0, 0, 3, 0, 2, 2, 0)

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.calls = 0

    def choose(self, num_rows: int) -> int:
        self.calls += 1
        self.k = self.SCHEDULE[(self.calls - 1) % len(self.SCHEDULE)]
        return self.k


@pytest.mark.parametrize("bound", [4096, 8])  # 8: most steps write what waited before they can defer their own
def test_dspark_deferred_context_writes_give_the_drafts_of_writing_every_step(tiny_checkpoints, tmp_path,
                                                                               monkeypatch, bound):
    """K = 0 steps at PCP 1 leave DSpark's context write for the next step that drafts (or the bound): on the same
    K schedule, every step's drafts equal those of a drafter that writes its context every step, prompt chunks,
    slots written twice and all."""
    from tandem.spec_decode import dspark_proposer

    monkeypatch.setattr("tandem.engine.llm_engine.SpecPolicy", _Scripted)
    monkeypatch.setattr(dspark_proposer, "MAX_DEFERRED_CONTEXT_TOKENS", bound)
    path = tiny_checkpoints("glm4_moe")
    bigrams = {}
    for prompt, out in zip(_engine_prompts(), _no_spec(path), strict=True):
        seq = prompt[-1:] + out
        bigrams.update({a: b for a, b in zip(seq, seq[1:], strict=False) if a not in bigrams})
    spec = {"method": "dspark", **AUTO,
            "model": str(build_dspark_drafter(path, tmp_path / "dspark", bigrams=bigrams, boost=20.0))}
    runs = []
    for defers in (True, False):
        monkeypatch.setattr("tandem.spec_decode.factory.defers_at_k0", lambda *args, d=defers: d)
        llm = LLM(str(path), **ENGINE, speculative_config=spec)
        try:
            steps = record_steps(llm, monkeypatch)
            llm.generate([{"prompt_token_ids": p} for p in _engine_prompts()], ENGINE_GREEDY, use_tqdm=False)
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        finally:
            llm.shutdown()
        runs.append(([(p.num_spec_tokens, o.draft_token_ids) for p, o in steps], metrics))
    (deferring, m), (writing, _) = runs
    assert sum(bool(d) for _, drafts in deferring for d in drafts) >= 10, "too few drafts to compare"
    for i, (a, b) in enumerate(zip(deferring, writing, strict=True)):
        assert a == b, f"step {i}: (K, drafts) {a} deferring the context writes, {b} writing every step"
    assert m["tandem:spec_decode_dspark_deferred_context_tokens"] > 0, "no context write deferred"
    assert m["tandem:spec_decode_dspark_caught_up_context_tokens"] > 0, "no deferred write caught up"


@pytest.mark.parametrize("backend", [None, "CONTIGUOUS_MLA"])  # PAGED_MLA (the sharded mode) and replicated
def test_drafts_after_k0_steps_equal_plain_recomputation(tiny_checkpoints, monkeypatch, backend):
    """Greedy output cannot tell a stale drafter (it only lowers acceptance), so this checks the drafts: after steps
    at K = 0 (MTP step 0 deferred, then run over the deferred tokens with the next step's), every first draft equals
    MTP recomputed from scratch for its context."""
    from test_spec_decode import _mtp_reference

    from tandem.spec_decode.mtp_catch_up import DeferredStep0

    # a fixed K schedule with runs of K = 0 steps: the timed policy (even _Restless) chose K = 0 rarely on a loaded
    # avx2 machine and left only one draft after a K = 0 step to check
    monkeypatch.setattr("tandem.engine.llm_engine.SpecPolicy", _Scripted)
    caught_up: list[int] = []  # deferred tokens taken by each catch-up
    extend = DeferredStep0.extend

    def counted(self, *args):
        ext = extend(self, *args)
        caught_up.append(0 if ext is None else int(ext.offsets[-1]))
        return ext

    monkeypatch.setattr(DeferredStep0, "extend", counted)
    path = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    spec = {"method": "mtp", **AUTO} | ({"attention_backend": backend} if backend else {})
    llm = LLM(str(path), **ENGINE, speculative_config=spec)
    steps = record_steps(llm, monkeypatch)
    prompts = _engine_prompts()[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], ENGINE_GREEDY, use_tqdm=False)
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    emitted_so_far = dict.fromkeys(full, 0)
    reference = _mtp_reference(path)
    checked_after_zero, previous_k = 0, None
    for plan, out in steps:
        sampling_rows = [r for r in plan.rows if r.sampling is not None]
        for s, (row, emitted) in enumerate(zip(sampling_rows, out.sampled_token_ids, strict=True)):
            emitted_so_far[row.request_id] += len(emitted)
            drafts = out.draft_token_ids[s] if out.draft_token_ids else []
            if not drafts:
                continue
            context = full[row.request_id][: len(prompts[int(row.request_id)]) + emitted_so_far[row.request_id]]
            assert drafts[0] == reference(context), f"request {row.request_id} after {len(context)} tokens"
            checked_after_zero += previous_k == 0
        previous_k = plan.num_spec_tokens
    assert checked_after_zero >= 3, f"only {checked_after_zero} drafts right after a K = 0 step were checked"
    assert sum(n > 0 for n in caught_up) >= 2, f"step 0 never caught up deferred tokens: {caught_up}"
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    assert metrics["tandem:spec_decode_mtp_deferred_step0_tokens"] > 0, "no deferred step 0 counted"
    # the start-up profile's catch-ups run through the executor, outside the engine's counters
    assert 0 < metrics["tandem:spec_decode_mtp_caught_up_tokens"] <= sum(caught_up), "caught-up tokens miscounted"


def test_policy_metrics_reach_prometheus():
    from tandem.entrypoints.openai.prometheus import render_metrics

    world = World([0.8] * K_MAX)
    policy = SpecPolicy(K_MAX)
    policy.set_costs(*world.profile(random.Random(0)))
    simulate(lambda: policy.choose(2), world, 2, 40, 7, policy)
    lines = render_metrics(policy.metrics(), "sharded").splitlines()

    def values(prefix: str) -> list[float]:
        return [float(line.split()[-1]) for line in lines if line.startswith(prefix)]

    assert sum(values("tandem:spec_policy_chosen_k_total{")) == 40
    assert len(values("tandem:spec_policy_chosen_k_total{")) == K_MAX + 1
    acceptance = values('tandem:spec_policy_acceptance_per_pos{position="0"}')  # a gauge per position: no _total
    assert acceptance and 0.6 < acceptance[0] < 0.95, acceptance


def test_a_step_of_only_new_rows_chooses_k_seeing_them(tiny_checkpoints, monkeypatch):
    """K is chosen before the step's rows are scheduled, except on a step with no decode row (a new batch): there
    the policy sees the rows admitted this step, not an empty running list."""
    seen: list[int] = []

    class Recording(SpecPolicy):
        def choose(self, num_rows: int) -> int:
            seen.append(num_rows)
            return super().choose(num_rows)

    monkeypatch.setattr("tandem.engine.llm_engine.SpecPolicy", Recording)
    _engine_run(tiny_checkpoints("deepseek_v3", num_mtp_layers=1), speculative_config={"method": "mtp", **AUTO})
    assert seen and all(seen), f"a step chose K seeing no row: {seen[:4]}"


def test_the_profile_prices_every_k_and_frees_its_rows(tiny_checkpoints, monkeypatch):
    """A fresh "auto" engine times K = 0..K_max at 1, 2, 4, ... rows before any request; its synthetic rows hold
    no KV block afterwards, and greedy output equals no speculation."""
    policies: list[SpecPolicy] = []
    monkeypatch.setattr("tandem.engine.llm_engine.SpecPolicy", lambda k: policies.append(SpecPolicy(k)) or policies[-1])
    path = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    llm = LLM(str(path), dtype="float32", speculative_config={"method": "mtp", **AUTO})
    try:
        policy = policies[0]
        assert policy.rows[:3] == [1, 2, 4] and all(len(t) == 4 and min(t) > 0 for t in policy.table), policy.table
        free = llm.engine.scheduler.block_manager.num_free_blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in _engine_prompts()], ENGINE_GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.block_manager.num_free_blocks == free
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _no_spec(path)
