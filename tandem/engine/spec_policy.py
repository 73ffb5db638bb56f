"""The "auto" K policy: before each step, the K in 0..K_max with the most expected tokens per second.

    rate(K) = E_K / seconds(rows, K),        E_K = 1 + sum_{j<=K} prod_{i<=j} a_i   (tokens a row emits)

- a_i, the acceptance of draft i given that the drafts before it were accepted: counts over the last ~HALF_LIFE
  verified rows (vLLM's per-position acceptance average). A position no recent step verified leans on the one
  before it, so the drafts a K never run would add are priced as the last position tried fared.
- seconds(rows, K): a table measured at start-up (`profile`: synthetic decode steps through the real executor at 1,
  2, 4, ... rows and every K, the median of ROUNDS), interpolated between row counts, times what served steps took
  over it (the profile's short contexts, the engine's own work around the executor): per (row count, K) the median
  ratio of its served steps among the last FRESH served, an entry with fewer than TRUSTED of them filling the
  missing votes with the median ratio of the last SHARED steps served at that row count, any K. The machine's speed
  drifts by 30% over tens of steps: a K last served in a slow minute must not keep that price (two slow K = 3 steps
  priced it 13.5 ms against 9 ms served, and it never ran again), nor may a K not served lately keep the profile's
  bare price while every step costs more (~800-token contexts: K flipped to a K it had not run, only to learn its
  price). A ratio, not a difference: attending long contexts costs in proportion to the tokens a step verifies.
- A switch of K discards the pending drafts (and from K = 0 catches deferred work up), so K moves only for a gain
  above SWITCH_MARGIN.
- At K = 0 no draft is verified, so acceptance would never be seen again: after `explore_after` steps there the
  policy drafts (at K = 1 or better); the wait doubles, up to MAX_EXPLORE_AFTER, while K = 0 stays best. Drafting
  that starts, by choice or to explore, goes on until MIN_EXPLORED rows in MIN_EXPLORED_STEPS steps verified drafts
  (at batch 1, K = 1 for two steps saw one draft, and three early rejections kept a drafter paying 1.4x at K = 0 for
  good), unless even an optimistic acceptance (each rate at its upper confidence bound) could not make it pay; nor
  does such a K = 0 explore.
- While drafting, every PROBE_EVERY steps two steps run at K + 1 or K - 1 in turn: position K + 1 is otherwise
  never verified (an estimate of it leaning on position K's, low by chance, can hold K below the best for good),
  and K - 1's price (K = 0's too) would stay the profile's alone (its small steps vary by 10% or more at batch 1).
Drafters declare nothing: the profile measures what their passes cost at each K, including the work a drafter defers
at K = 0 (MTP's step 0, DSpark's context write) and catches up later. Rank 0 only, no torch.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable

from tandem.config import EngineConfig
from tandem.engine.metrics import Metric, Vector
from tandem.step_plan import RowSampling, ScheduledRow, StepOutput, StepPlan

logger = logging.getLogger("tandem")

SWITCH_MARGIN = 0.03
HALF_LIFE = 96.0  # verified rows over which an acceptance count halves
STALE_HALF_LIFE = 64.0  # steps verifying nothing over which the evidence behind it halves: it ages
FIRST_PRIOR, FIRST_WEIGHT = 0.5, 2.0  # a_1 before any verification, in pseudo-counts
# pseudo-counts of a later position toward the one before it: conditional rates differ little between positions,
# and at batch 1 two early rejections at position 2 otherwise held MTP at K = 1 for 60 steps
POOL_WEIGHT = 8.0
RECENT = 9  # served steps whose median ratio to the table corrects an entry: a stall moves no median
FRESH = 16  # served steps after which one no longer prices its entry: older ones are another minute's speed
TRUSTED = 2  # an entry's fresh served steps before they alone price it
SHARED = 5  # the last served steps at a row count, any K, that fill an entry's missing votes
OPTIMISM = 2.0  # standard errors: drafting at K = 0 is tried only where it could pay
PROBE_EVERY = 32
EXPLORE_AFTER, MAX_EXPLORE_AFTER = 32, 512
# verified rows and verifying steps before drafting that started may stop: at batch 1 a few Bernoulli draws mislead,
# and at batch 8 one step's rows did (the first drafts after a prompt are accepted least)
MIN_EXPLORED, MIN_EXPLORED_STEPS = 8, 3
MAX_PROFILED_ROWS = 64  # above it, seconds are extrapolated from the two largest row counts
PROFILE_PROMPT = 32  # tokens of each synthetic row's prompt
# rounds over K = 0..K_max per row count, each K a pair of steps of which the second is timed (the first verifies
# the last K's drafts, not K's); rounds, so that a drift of the machine's speed hits every K alike
ROUNDS, SMALL_ROUNDS = 2, 5  # SMALL_ROUNDS at 1 and 2 rows, whose few-ms steps vary most and cost least
GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)


class SpecPolicy:
    def __init__(self, max_k: int):
        self.max_k = max_k
        # nominal costs until `profile` (or where it found no room): cheap drafting, so that served steps at every K
        # correct them
        self.set_costs([1], [[1e-3 * (1.0 + 0.1 * k) for k in range(max_k + 1)]])
        self.accepted, self.tried = [0.0] * max_k, [0.0] * max_k  # decayed counts per draft position
        self.evidence = [0.0] * max_k  # `tried`, aged by steps that verify nothing too: the bound's width
        self.k = 0
        # a fresh engine's first stop rests on a few rows, the first drafts after a prompt, which are accepted least
        # (bundled MTP: 0.69 over a request's first 10 drafts, 0.9 after them): it looks again sooner
        self.steps_at_zero, self.explore_after = 0, EXPLORE_AFTER // 2
        # rows and steps that verified drafts since drafting last started: a fresh engine drafts until it has seen some
        self.explored = self.explored_steps = 0
        self.steps_drafting = 0
        self.chosen = [0] * (max_k + 1)

    def set_costs(self, rows: list[int], seconds: list[list[float]]) -> None:
        """`seconds[i][K]`: a step of rows[i] decode rows at K (ascending row counts)."""
        self.rows, self.table = rows, seconds
        # served / profiled seconds: (served step number, ratio) per row count and K; ratios per row count, any K
        self.recent: list[list[deque[tuple[int, float]]]] = [[deque(maxlen=RECENT) for _ in range(self.max_k + 1)]
                                                             for _ in rows]
        self.shared: list[deque[float]] = [deque(maxlen=SHARED) for _ in rows]
        self.served = 0

    # -- pricing -------------------------------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        rates, before, weight = [], FIRST_PRIOR, FIRST_WEIGHT
        for accepted, tried in zip(self.accepted, self.tried, strict=True):
            before = (accepted + weight * before) / (tried + weight)
            weight = POOL_WEIGHT
            rates.append(before)
        return rates

    def expected_tokens(self, optimistic: bool = False) -> list[float]:
        """E_K for K = 0..K_max: the tokens a decode row emits in a step that verifies K drafts; `optimistic`: each
        rate at its upper confidence bound, OPTIMISM standard errors above (its counts are what it knows)."""
        out, run = [1.0], 1.0
        for rate, tried in zip(self.acceptance(), self.evidence, strict=True):
            if optimistic:
                rate = min(rate + OPTIMISM * math.sqrt(rate * (1 - rate) / (tried + FIRST_WEIGHT)), 1.0)
            run *= rate
            out.append(out[-1] + run)
        return out

    def _profiled(self, num_rows: int) -> tuple[list[float], int]:
        """The table interpolated at num_rows (extrapolated past its ends), and the nearest row count's index."""
        rows = self.rows
        if len(rows) == 1:
            return [t * num_rows / rows[0] for t in self.table[0]], 0
        i = min(max(bisect.bisect_right(rows, num_rows) - 1, 0), len(rows) - 2)
        w = (num_rows - rows[i]) / (rows[i + 1] - rows[i])  # > 1 past the last row count
        return [max((1 - w) * a + w * b, 1e-9) for a, b in zip(self.table[i], self.table[i + 1], strict=True)], \
            i + (w > 0.5)

    def seconds(self, num_rows: int) -> list[float]:
        """Predicted seconds of a step of num_rows decode rows at each K = 0..K_max."""
        profiled, nearest = self._profiled(num_rows)
        shared = statistics.median(self.shared[nearest]) if self.shared[nearest] else 1.0
        out = []
        for t, recent in zip(profiled, self.recent[nearest], strict=True):
            own = [ratio for step, ratio in recent if self.served - step < FRESH]
            out.append(max(t * statistics.median([*own, *[shared] * (TRUSTED - len(own))]), 1e-9))
        return out

    # -- choosing ------------------------------------------------------------------------------------------------
    def choose(self, num_rows: int) -> int:
        """K for the next step over num_rows running rows (decodes, or the prompts a new batch admits)."""
        best, hopeful = self.k, True
        if num_rows:
            seconds = self.seconds(num_rows)
            rate = [e / s for e, s in zip(self.expected_tokens(), seconds, strict=True)]
            top = max(range(self.max_k + 1), key=rate.__getitem__)
            if rate[top] >= (1 + SWITCH_MARGIN) * rate[self.k]:
                best = top
            hopeful = max(e / s for e, s in zip(self.expected_tokens(True)[1:], seconds[1:], strict=True)) > rate[0]
        run = best
        if best == 0 and hopeful and (self.explored < MIN_EXPLORED or self.explored_steps < MIN_EXPLORED_STEPS):
            best = run = 1
        elif best == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero >= self.explore_after:
                self.steps_at_zero = 0
                if hopeful:
                    best = run = 1
                    self.explore_after = min(2 * self.explore_after, MAX_EXPLORE_AFTER)
        else:
            self.steps_at_zero, self.explore_after = 0, EXPLORE_AFTER
            self.steps_drafting += 1
            if self.steps_drafting >= PROBE_EVERY and self.steps_drafting % PROBE_EVERY < 2:  # propose, verify
                up = self.steps_drafting // PROBE_EVERY % 2 == 0  # up and down in turn
                run = best + 1 if up and best < self.max_k else best - 1 if not up else best
        if best and not self.k:
            self.explored = self.explored_steps = self.steps_drafting = 0
        self.k = best
        self.chosen[run] += 1
        return run

    # -- learning ------------------------------------------------------------------------------------------------
    def record_step(self, plan: StepPlan, output: StepOutput, step_s: float) -> None:
        """A served step ran in step_s seconds (rank 0's wall time)."""
        accepted, tried = [0] * self.max_k, [0] * self.max_k
        verified = 0
        sampling = [row for row in plan.rows if row.sampling is not None]
        for row, emitted in zip(sampling, output.sampled_token_ids, strict=False):
            drafts = min(row.num_draft_tokens, self.max_k)
            if drafts:
                verified += 1
                hits = len(emitted) - 1  # accepted drafts
                for j in range(min(hits + 1, drafts)):
                    tried[j] += 1
                    accepted[j] += j < hits
        self.explored += verified
        self.explored_steps += verified > 0
        if verified:
            keep = 0.5 ** (verified / HALF_LIFE)
            self.accepted = [keep * a + n for a, n in zip(self.accepted, accepted, strict=True)]
            self.tried = [keep * t + n for t, n in zip(self.tried, tried, strict=True)]
            self.evidence = [keep * t + n for t, n in zip(self.evidence, tried, strict=True)]
        elif plan.rows:
            self.evidence = [t * 0.5 ** (1 / STALE_HALF_LIFE) for t in self.evidence]
        k = plan.num_spec_tokens
        # the time of a steady decode step at k corrects its table entry: not a step with prompt tokens, one that
        # verifies another K's drafts (right after a switch), or one that catches up deferred drafter work
        steady = plan.rows and k <= self.max_k and not output.draft_stats.get("catch_up_tokens") and all(
            not r.is_prefill and len(r.token_ids) == 1 + r.num_draft_tokens for r in plan.rows) and max(
            r.num_draft_tokens for r in plan.rows) == k
        if steady:
            profiled, nearest = self._profiled(len(plan.rows))
            self.served += 1
            self.recent[nearest][k].append((self.served, step_s / profiled[k]))
            self.shared[nearest].append(step_s / profiled[k])

    def metrics(self) -> list[Metric]:
        return [Vector("tandem:spec_policy_chosen_k", list(self.chosen), label="k"),
                Vector("tandem:spec_policy_acceptance_per_pos", self.acceptance(), kind="gauge")]


def profile(policy: SpecPolicy, execute: Callable[[StepPlan], StepOutput], config: EngineConfig,
            num_blocks: int) -> list[str]:
    """Times synthetic decode steps at 1, 2, 4, ... rows and every K into `policy`'s cost table, before any request
    (nothing is cached yet, so the random prompts' blocks are only overwritten later). Returns the synthetic
    request ids, for the next plan to free on every rank."""
    k_max, block = policy.max_k, config.cache_config.block_size
    budget = config.scheduler_config.max_num_batched_tokens
    prompt = min(PROFILE_PROMPT, budget, config.model_config.max_model_len // 4)
    most = min(config.scheduler_config.max_num_seqs, MAX_PROFILED_ROWS, budget // (k_max + 1))
    counts = [1 << i for i in range(max(most, 0).bit_length())]
    def rounds(c: int) -> int:
        return SMALL_ROUNDS if c <= 2 else ROUNDS

    # a row runs 2 rounds(c) steps at each K for every row count c above its index, growing K + 1 tokens a step
    # at most, and the drafter writes K_max slots past it
    growth = (k_max + 1) * (k_max + 2) // 2
    tail = config.speculative_config.num_lookahead_slots + 1
    while counts:
        lengths = [prompt + sum(2 * rounds(c) for c in counts if c > r) * growth + tail for r in range(counts[-1])]
        if lengths[0] <= config.model_config.max_model_len and sum(-(-n // block) for n in lengths) <= num_blocks:
            break
        counts.pop()
    if prompt < 2 or not counts:
        logger.info('num_speculative_tokens "auto": no room to profile the step costs; served steps will learn them')
        return []
    rng, vocab = random.Random(0), int(config.model_config.get("vocab_size") or 2)
    rows: list[tuple[str, list[int], list[int]]] = []  # (request id, block ids, tokens) per synthetic row
    drafts: dict[str, list[int]] = {}
    first = 0
    for r, n in enumerate(lengths):
        rows.append((f"profile-{r}", list(range(first, first + -(-n // block))),
                     [rng.randrange(vocab) for _ in range(prompt)]))
        first += len(rows[-1][1])

    def step(subset: list[tuple[str, list[int], list[int]]], k: int, prefill: bool) -> float:
        scheduled = [ScheduledRow(rid, list(tokens), 0, blocks, True, GREEDY) if prefill else
                     ScheduledRow(rid, [tokens[-1], *drafts[rid][:k]], len(tokens) - 1, blocks, False, GREEDY,
                                  num_draft_tokens=k) for rid, blocks, tokens in subset]
        start = time.perf_counter()
        output = execute(StepPlan(scheduled, num_spec_tokens=k))
        seconds = time.perf_counter() - start
        for s, (rid, _, tokens) in enumerate(subset):
            tokens += output.sampled_token_ids[s]
            proposed = list(output.draft_token_ids[s]) if output.draft_token_ids else []
            # random prompts give an n-gram drafter nothing to match: without padding its K > 0 steps would verify
            # no draft and be priced as K = 0 steps
            drafts[rid] = proposed + [rng.randrange(vocab) for _ in range(k_max - len(proposed))]
        return seconds

    per_prefill = max(budget // prompt, 1)
    for start in range(0, len(rows), per_prefill):
        step(rows[start:start + per_prefill], k_max, prefill=True)
    table = []
    for c in counts:
        timings: list[list[float]] = [[] for _ in range(k_max + 1)]
        for _ in range(rounds(c)):
            for k in range(k_max + 1):
                step(rows[:c], k, prefill=False)
                timings[k].append(step(rows[:c], k, prefill=False))
        table.append([statistics.median(t) for t in timings])
    policy.set_costs(counts, table)
    logger.info('num_speculative_tokens "auto": step seconds at %s rows, K = 0..%d: %s', counts, k_max,
                "; ".join(" ".join(f"{1e3 * s:.1f}" for s in t) + " ms" for t in table))
    return [rid for rid, _, _ in rows]
