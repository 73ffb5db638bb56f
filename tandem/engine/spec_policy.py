"""The "auto" K policy: before each step, the K in {0..K_max} that maximises expected emitted tokens per second.

For a candidate K, the next step verifies each running request's drafts and proposes K new ones:
    emitted(K) = sum_r 1 + sum_{j<=K} prod_{i<=j} fill_ri accept_ri        (acceptance.py, per request)
    seconds(K) = target(shape(K)) + draft(shape(K), K)                      (cost_model.py, fitted online)
where shape(K) holds the running requests' rows with 1 + E[drafts] tokens each at their contexts. K = 0 still
runs what a drafter must do to keep its own KV current (DSpark's context); MTP defers its step 0 of a decode step
at K = 0 to the next step that drafts (mtp_catch_up.py). The draft model prices what each K measured.

Acceptance is observed only while drafting, so after `explore_after` steps at K = 0 the policy drafts at the K >= 1
priced best for two steps (one proposes, the next verifies; at a few rows, until it has verified MIN_EXPLORED_DRAFTS
first drafts while they break even: `_extends`) to refresh it; each exploration that does not switch drafting back
on doubles the wait (up to `max_explore_after`), so a drafter that never pays costs two cheap steps in that many,
unless drafting was priced within NEAR_TIE of K = 0 (a near tie is explored every `explore_after` steps, except where
the catch-up of MTP's deferred step 0, paid by every exploration, costs more than CHEAP_CATCH_UP of a plain step).
A switch from K = 0 to drafting pays that catch-up too: it needs the margin with the catch-up spread over the steps
the rows have left (`_stays_worth_catch_up`).
An exploration runs only where drafting could pay: some K >= 1 beats K = 0 with each draft position's rejection
rate halved (EXPLORE_OPTIMISM: the estimates may be stale, but not by that much: at long contexts and large
batches verification tokens cost more than even a much better drafter would save, and an exploration there, with
MTP's catch-up of every deferred token, is pure loss; with "every draft accepted" as the bound, DSpark's K = 3 at
~8k keys, batch 8, acceptance length 1.64 of 4, looked like it could pay and explored at 106-135 ms a step against
40 ms); until then the wait stays due, up to `max_explore_after` steps, when the policy explores anyway to refresh
the fitted costs of drafting.
Drafting that pays ends the back-off only at no fewer rows than that exploration had (a batch's few-row tail,
where drafting is cheap, does not restart it for the next full batch).
While drafting, the policy likewise runs K = 0 for two steps (one verifies without proposing, the next is a plain
decode) after `explore_after` drafting steps, doubling that wait each time drafting stays best: a run at one K
measures only that K's step, and K = 0's price, extrapolated from steps long gone, can drift past the margin
with nothing to correct it. Probes rotate over K = 0 and one K either side of the K they interrupt: a run at one K
observes none of the draft passes a higher K adds, whose prices otherwise stay what calibration made them.
A switch of K discards the pending drafts, so K changes only for a gain above `switch_margin` (a third of it for a
move up between drafting Ks, which discards nothing).
A batch of a size no served step drafted at (within 2x) explores once, on the usual wait, whatever could_pay says:
its drafting prices are the calibration's extrapolation. The fits are re-solved before an exploration's verdict,
and after such a first exploration with the calibration's prior faded out, so the steps just served decide.
An exploration whose first drafts were accepted far above the estimate it began with runs on (`_extends`).
What the policy itself costs is paid by every step: a K = 0 decision over the same decode rows is held for HOLD
steps without pricing, and prices are reused for REPRICE_EVERY steps.
Rank 0 only, no torch: the scheduler asks `choose`, the engine reports each step with `record_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.engine.metrics import Counter, Gauge, Metric, Vector
from tandem.engine.spec_acceptance import PositionRates
from tandem.engine.spec_cost_model import (
    DRAFT_TERMS,
    TARGET_TERMS,
    LinearCostModel,
    StepShape,
    duplicate_keys,
    duplicate_keys_of,
    shared_blocks,
)
from tandem.step_plan import STEP0_DEFERRED, StepOutput, StepPlan, attended_keys

# an exploration while the best K >= 1 is priced within this fraction of K = 0's rate does not double the wait for
# the next: two steps that lose at most ~10% each, every explore_after steps, cost ~1% of the rate, and a near tie
# is where a K >= 1 priced high early (its terms settle while it runs) most needs new observations (GSM8K batch 1,
# MTP: K = 1 priced 17.5 ms on average against 13.8 measured, and "auto" kept K = 0 at 0.92x no-spec)
NEAR_TIE = 0.9
EXPLORE_OPTIMISM = 0.5  # could_pay: each position's acceptance estimate moved this share of the way to 1
# What "auto" runs each step is paid by every step, and no fixed K pays it: inside the engine (after the model's
# step, with the interpreter's caches cold) each small numpy call costs ~3x what it does in a loop of its own, and
# the full choice and record cost ~0.25 ms at K = 0 and ~0.7 ms while drafting at batch 1, on a 4-5 ms step
# ("auto" read 0.88x no-spec there, and its K = 2 steps 5.25 ms against a fixed K = 2 engine's 4.55). So:
# a batch of the same rows keeps its prices this many steps (contexts grow by a token or a few a step)
REPRICE_EVERY = 4
# a decision of K = 0 over the same decode rows stands this many steps: the steps in between run no pricing and
# no exploration check (an exploration comes at most HOLD - 1 steps late)
HOLD = 8
# (every step still feeds the cost fit: fed one held step in 4, the fits moved enough that "auto" came back to
# drafting after a drafter's bad stretch in 4 of 8 synthetic streams, against 7 of 8 unthinned)
# An exploration at a size no served step drafted at runs this many steps more, and its fits skip its first this many:
# those carry one-time costs (the catch-up of every deferred token, first calls at new sizes) and would otherwise
# be the only served evidence once the prior fades. MTP at batch 8 on GSM8K: the first K = 1 steps took 37.5 and 30.7
# ms (draft 25.0 and 11.3), steady ones ~16.6 (draft ~3.5), and K = 1 was priced 31 ms from them
COLD_STEPS = 2
# an exploration drafts at the K priced best of those whose draft passes add at most this share of a K = 1 step to
# K = 1's (_exploring_k): a block drafter's every K, n-gram's, not MTP's draft decodes (~12% of a step each)
CHEAP_DRAFT = 0.05
EXTEND_GAP = 0.3  # an exploration extends where its first drafts were accepted this much above the estimate
MAX_EXTENSIONS = 3  # (_extends)
CATCH_UP_HORIZON = 64  # a switch from K = 0 spreads its catch-up over at most this many steps (_stays_worth_catch_up)
CHEAP_CATCH_UP = 0.5  # a near tie is explored on schedule where the catch-up costs at most this share of a K = 0 step
MIN_EXPLORED_DRAFTS = 8  # an exploration extends until it has verified this many first drafts (batch 1: ~9 steps)
MAX_THIN_EXTENSIONS = 4


@dataclass(frozen=True)
class RunningRow:
    """What the policy reads of a running request: its id, tokens so far and tokens still to compute."""

    request_id: str
    num_tokens: int
    num_new_tokens: int  # 1 for a decode (plus drafts), more for an unfinished prompt
    block_ids: Sequence[int] = ()  # its KV blocks (rows sharing leading blocks read those keys once)
    tokens_left: int = 1 << 30  # output tokens it may still emit (max_tokens, max_model_len): how long a switch lasts


class SpecPolicy:
    def __init__(self, max_k: int, explore_after: int = 16, max_explore_after: int = 256, switch_margin: float = 0.03,
                 defers_step0: bool = False, max_deferred_tokens: int = 256, block_size: int = 16,
                 costly_catch_up: bool | None = None, first_reads_shared_once: bool = True):
        self.max_k, self.switch_margin, self.block_size = max_k, switch_margin, block_size
        # MTP's step 0 (mtp_catch_up.py) and DSpark's context write (dspark_proposer.py) are deferred at K = 0 where
        # every row is a decode or a prompt's last chunk of at most max_deferred_tokens: those steps price no step 0
        self.defers_step0, self.max_deferred_tokens = defers_step0, max_deferred_tokens
        # the catch-up runs the drafter's attention over the deferred tokens (MTP), not only a projection (DSpark)
        self.costly_catch_up = defers_step0 if costly_catch_up is None else costly_catch_up
        # the first draft reads shared prefix keys once (MTP, on the target's cascade metadata) or per row (DSpark)
        self.first_reads_shared_once = first_reads_shared_once
        self.accept = PositionRates(max_k)
        self.fill = PositionRates(max_k, prior=0.9)  # model drafters always fill; n-gram learns its own rate
        self.target = LinearCostModel(TARGET_TERMS)
        self.draft = LinearCostModel(DRAFT_TERMS)
        self.base_explore_after, self.max_explore_after = explore_after, max_explore_after
        self.explore_after = explore_after
        self.probe_after = explore_after  # drafting steps before the next K = 0 probe (doubles while drafting pays)
        self.steps_drafting = 0
        self._probe_left = 0  # probe steps still to run
        self._probe_k = 0  # the K a probe runs: 0, or one either side of the K it interrupts
        self._probe_turn = 0  # probes rotate over K = 0 and the Ks either side of the one they interrupt
        self._resume_k: int | None = None  # the K a probe interrupted: the next choice weighs a switch from it
        self._explored_rows = 0  # rows of the last exploration that switched nothing back on
        self.steps_at_zero = 0
        self.chosen = np.zeros(max_k + 1, dtype=np.int64)  # histogram of chosen K
        self.predicted_emitted = 0.0  # summed over the steps it chose for
        self.realised_emitted = 0
        self._pending_prediction: float | None = None
        self._explore_left = 0  # exploration steps still to run: one proposes, the next verifies
        self._explore_k = 1  # the K the exploration running drafts at
        self._draft_seconds = np.zeros(max_k + 1)  # the draft share of the last `expected` seconds
        self._priced_draft = np.zeros(max_k + 1)  # the draft share of `_priced`'s seconds (_exploring_k)
        self._refit_due = False  # an exploration just ended: re-solve the fits with its steps before its verdict
        self._exploring = False  # this step is an exploration's
        self._explored = [0, 0]  # the exploration's verified first drafts: accepted, tried
        self._explore_prior = 0.0  # the global first-draft acceptance estimate when it began
        self._extensions = 0  # times this exploration was extended
        self._thin_extensions = 0  # of them, for too few verified drafts
        self._fade_at_verdict = False  # the exploration running is the first at its batch size
        self._unobserved = 0  # steps still to run whose costs the fits skip (COLD_STEPS)
        self._unserved_ks: set[int] = set()  # Ks no served step ran since the prior faded: moved up to by a probe
        self._drafted_rows: set[int] = set()  # the sampling rows of every served step that drafted
        self._last_k = 0
        self.last_seconds = np.zeros(max_k + 1)  # [K_max + 1] predicted seconds of the last decode step's choice
        self._priced: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))  # the last `expected`, its rows
        self._priced_key: tuple = ()
        # could_pay's optimistic prices, reused while the rows, the fits and the acceptance estimates stay the same,
        # for up to REPRICE_EVERY calls (it runs at every K = 0 step past explore_after: at batch 32, ~0.5 ms a step)
        self._optimistic: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
        self._optimistic_key: tuple = ()
        self._optimistic_age = 0
        self._priced_age = 0
        self._deferred: dict[str, int] = {}  # request -> tokens whose step 0 waits (costly_catch_up drafters)
        self._hold_left = 0  # steps the last K = 0 decision still stands (HOLD), for `_hold_rows` decode rows
        self._hold_rows = 0
        self._held = False  # this step's K came from a hold
        self._steady = False  # this step runs the last step's K, neither exploring nor probing
        self._was_steady = False  # the last step was steady (after any other, prices are made afresh)
        self._held_emitted = 0.0  # the held decision's expected emitted tokens

    # -- choosing ------------------------------------------------------------------------------------------------
    def choose(self, running: list[RunningRow], new_batch: bool = False) -> int:
        """`new_batch`: no row verifies drafts this step (the scheduler found no decode row running before it
        admitted these), so K only sets the drafts they propose at its end: weighed as below, even for rows a prefix
        hit left with one token to compute (which the rows alone cannot tell from decodes)."""
        self._was_steady, self._held, self._steady, self._exploring = self._steady, False, False, False
        if self._hold_left and not new_batch and len(running) == self._hold_rows and all(
                r.num_new_tokens == 1 for r in running):
            # the last decision (K = 0, nothing due) stands: what the K = 0 branch below does, without the pricing
            self._hold_left -= 1
            self._held = self._steady = True
            self.steps_at_zero += 1
            return self._commit(0, self._held_emitted)
        self._hold_left = 0
        if new_batch:
            # only admissions and prompt chunks (a new batch): the drafts proposed now are verified by the decode
            # step these rows make next, so weigh K by that step (new requests at the global acceptance estimate),
            # not by the K the last batch's tail paid for (a 32-row batch inherited K = 3 from a 2-row tail).
            # Before the costs are fitted, or with no row at all, the K that paid last (K = 0 there, every rate
            # being 0, would cost each new batch a step without drafts)
            if not running or not (self.target.ready and self.draft.ready):
                return self._commit(self._last_k, 0.0)
            rows = [RunningRow(r.request_id, r.num_tokens, 1, r.block_ids) for r in running]
            emitted, seconds = self.expected(rows)
            rate = emitted / np.maximum(seconds, 1e-9)
            best = int(np.argmax(rate))
            # drafting starts only for the switch margin: the acceptance it is priced at is the last batch's (its
            # tail's, often), and a batch of 32 that started at K = 1 on it paid ~2x a step until it learnt better
            return self._commit(best if rate[best] >= (1 + self.switch_margin) * rate[0] else 0, 0.0)
        verdict = self._refit_due
        probed = self._resume_k is not None and not self._probe_left
        if verdict or probed:  # an exploration's or probe's verdict: priced with its steps in the fits (they
            self._refit_due = False  # refit every 8th observation: a probe up's draft decodes would wait)
            fade = verdict and self._fade_at_verdict  # the first served steps of drafting at this size decide
            for model in (self.target, self.draft):
                if fade:
                    model.fade_prior()
                    model.refit()
                else:
                    model.refresh()
            if fade:
                # the draft decodes of K >= 2, which the exploration (K = 1) did not run, are now priced by the
                # faded prior and whatever served steps ran of them: a move up to such a K runs as a probe first
                # (batch-8 MTP went K = 1 -> 3 at once and stayed there, at 0.87x and 0.81x the best in two runs)
                self._unserved_ks = set(range(2, self.max_k + 1))
            self._fade_at_verdict = False
        emitted, seconds = self._prices(running)
        self.last_seconds = seconds  # the prices of this choice, for benchmarks' traces
        if not (self.target.ready and self.draft.ready):
            k = self.max_k - int(self.chosen.sum()) % (self.max_k + 1)  # not seeded yet: sweep K to fit costs
            return self._commit(k, float(emitted[k]))
        rate = emitted / np.maximum(seconds, 1e-9)
        resumed = probed
        if resumed:  # a probe ended: staying at K = 0 needs the margin
            self._last_k, self._resume_k = self._resume_k, None
        best = argmax = int(np.argmax(rate))
        # a move up between drafting Ks discards nothing (the pending drafts are all verified) and catches nothing
        # up, so it needs only a third of the margin: at the full margin, a K priced 2-3% above the current one
        # from stale estimates of a position never tried at it could hold a K 6% below the best for ~90 steps
        margin = self.switch_margin / 3 if 0 < self._last_k < best else self.switch_margin
        if rate[best] < (1 + margin) * rate[self._last_k]:
            best = self._last_k  # a switch discards the pending drafts: only a clear gain is worth it
        elif self._last_k == 0 and not self._stays_worth_catch_up(running, emitted, seconds, best, margin):
            best = 0
        if self._explore_left:
            self._explore_left -= 1
            best = best or self._explore_k
            self._refit_due = not self._explore_left
            self._exploring = True
        elif self._probe_left:
            self._probe_left -= 1
            best = self._probe_k
        elif best == 0 and verdict and self._extends():
            self._explore_left, self._exploring, best = 1, True, self._explore_k
        elif best == 0:
            self.steps_drafting, self.probe_after = 0, self.base_explore_after
            self.steps_at_zero += 1
            # acceptance is stale: draft two steps to refresh it, where a K >= 1 could pay at all or drafting's
            # price here has no served steps behind it (an extrapolation from the calibration: at batch 32, MTP's
            # K = 1 was priced 1.48x its cost from calibration steps of at most 5 rows, and never explored), or in
            # any case after max_explore_after steps (the fitted costs of drafting, unobserved at K = 0, go stale)
            # (could_pay once a step: its reused prices age by call)
            pays = self.steps_at_zero >= self.explore_after and self.could_pay(running, rate[0])
            extrapolated = self.steps_at_zero >= self.explore_after and not pays and self._extrapolated(running)
            if self.steps_at_zero >= self.max_explore_after or pays or extrapolated:
                self._fade_at_verdict = extrapolated
                self.steps_at_zero, self._explore_left, self._exploring = 0, 1, True
                if extrapolated:  # its steps will price drafting here alone: two more, past the one-time costs
                    self._explore_left, self._unobserved = 1 + COLD_STEPS, COLD_STEPS
                self._explored, self._extensions, self._thin_extensions = [0, 0], 0, 0
                self._explore_prior = float(self.accept.global_estimate()[0])
                # a near tie keeps the wait, exploring it costs little; not where the catch-up of MTP's deferred step 0
                # costs more than CHEAP_CATCH_UP of a plain step (at ~8k keys, 8 rows, explored every 16 steps: 0.80x
                # no-spec); at batch 1 on GSM8K it is a few tokens at ~1k keys, and a doubling wait there left "auto"
                # at K = 0 on a stale estimate where K = 1 paid 1.07x no-spec
                cheap = self._catch_up_s(running) <= CHEAP_CATCH_UP * self.last_seconds[0]
                if not cheap or rate[1:].max() < NEAR_TIE * rate[0]:
                    self.explore_after = min(2 * self.explore_after, self.max_explore_after)
                self._explored_rows = len(running)
                self._explore_k = 1 if extrapolated else self._exploring_k(rate)
                best = self._explore_k
            elif self._last_k == 0 and all(r.num_new_tokens == 1 for r in running):
                # K = 0 stays: hold it over the same decode rows up to the next step an exploration can fall due at
                # (explore_after; past it, where could_pay said no, max_explore_after)
                due = (self.explore_after if self.steps_at_zero < self.explore_after
                       else self.max_explore_after) - self.steps_at_zero
                self._hold_left = max(min(HOLD - 1, due - 1), 0)
                self._hold_rows, self._held_emitted = len(running), float(emitted[0])
                self._steady = True
        else:  # drafting pays, and refreshes the acceptance estimates as it goes
            self.steps_at_zero = 0
            if argmax > 0 and len(running) >= self._explored_rows:
                # best outright (not only kept by the switch margin) at no fewer rows than the exploration that
                # found it did not pay: the back-off ends. A batch's tail (a few rows, where drafting is cheap)
                # keeps it, or every batch would explore afresh at 16 steps
                self.explore_after = self.base_explore_after
            self.steps_drafting += 1
            if best > self._last_k and best in self._unserved_ks:  # a probe up, then the choice with its steps
                self._probe_k, self._probe_left, self._resume_k = best, 1, self._last_k
            elif self.steps_drafting >= self.probe_after:  # measure K = 0 again: two steps, as an exploration
                # probes rotate over K = 0, K + 1 and K - 1: a run at one K observes none of the draft decodes a
                # higher K adds (at batch 1 MTP's K = 3 stayed priced at 16.1 ms a step, where fixed it ran 12.4 ms
                # and paid 1.21x no-spec, while "auto" ran K = 1 at 0.86x it), and a K below drifts unobserved too
                # (n-gram at batch 1 ran K = 2-3 with K = 1 priced 6.9 ms, fixed 6.0, paying 1.25x no-spec)
                turns = [0, *([best + 1] if best < self.max_k else []), *([best - 1] if best > 1 else [])]
                self._probe_k = turns[self._probe_turn % len(turns)]
                self._probe_turn += 1
                self.steps_drafting, self._probe_left, self._resume_k, best = 0, 1, best, self._probe_k
                self.probe_after = min(2 * self.probe_after, self.max_explore_after)
            else:
                self._steady = best == self._last_k and not resumed
        return self._commit(best, float(emitted[best]))

    def _exploring_k(self, rate: np.ndarray) -> int:
        """The K an exploration drafts at: the one priced best of those whose draft passes cost about what K = 1's
        do (within CHEAP_DRAFT of K = 1's step). DSpark's block drafter runs one pass for every K, so its K = 1 is its
        worst (0.89x no-spec at batch 8, K = 3 1.0-1.14x) and a near tie explored there every 16 steps cost "auto"
        ~5% against no-spec; MTP adds a draft decode a K, and explored at a K >= 2 priced best on stale terms (K = 1
        priced 11.0 ms where it ran 8.4 at batch 1) it stayed there at 0.81x the best. (A first exploration at a size,
        its prices the calibration's, runs K = 1; the probe up takes it on.)"""
        draft, limit = self._priced_draft, self._priced_draft[1] + CHEAP_DRAFT * self.last_seconds[1]
        return max((k for k in range(1, self.max_k + 1) if draft[k] <= limit), key=lambda k: rate[k])

    def _extends(self) -> bool:
        """An exploration runs two more steps while it has verified fewer than MIN_EXPLORED_DRAFTS first drafts and
        they were accepted at least as often as K = 1 needs to break even (up to MAX_THIN_EXTENSIONS times): at
        batch 1 its two steps verify one draft, and verdicts on one Bernoulli draw each kept MTP at K = 0 (GSM8K
        batch 1: acceptance estimated 0.40-0.50 after eight batches where the fixed K = 1 engine's was 0.70 and K = 1
        paid 1.07x no-spec; "auto" read 0.92x). And one whose verified first drafts were accepted far more often than
        the estimate it began with (EXTEND_GAP) runs two more steps, up to MAX_EXTENSIONS times: the estimate is
        stale, and a few steps of evidence at batch 1 barely move it (after a stretch where the drafter failed, one
        read 0.31 for a drafter now accepted 90% of the time, and "auto" took 4-8 explorations, hundreds of steps, to
        draft again)."""
        accepted, tried = self._explored
        # the acceptance at which K = 1 breaks even with K = 0 at these prices: below it so far, more steps are not
        # worth their cost (a drafter that fails keeps its two-step explorations)
        seconds, fill = self.last_seconds, max(float(self.fill.global_estimate()[0]), 1e-3)
        break_even = (seconds[1] / max(seconds[0], 1e-9) - 1.0) / fill
        if 0 < tried < MIN_EXPLORED_DRAFTS and self._thin_extensions < MAX_THIN_EXTENSIONS and \
                accepted >= break_even * tried:
            self._thin_extensions += 1
            return True
        if self._extensions >= MAX_EXTENSIONS or not tried or accepted / tried < self._explore_prior + EXTEND_GAP:
            return False
        self._extensions += 1
        return True

    def _prices(self, running: list[RunningRow]) -> tuple[np.ndarray, np.ndarray]:
        """`expected(running)`, reused for up to REPRICE_EVERY steps while the rows (and which are prompts) stay the
        same and the cost models are not re-solved: at K = 0 nothing new is learnt of acceptance, and while drafting
        the estimates move by a few % a step (a switch comes at most REPRICE_EVERY - 1 steps late); priced afresh
        at every step that explores or probes and after any step that was not steady (an exploration's verdict is
        the acceptance its last step verified: prices from before it would ignore it)."""
        key = (tuple((r.request_id, r.num_new_tokens > 1) for r in running), self.target.num_fits,
               self.draft.num_fits)
        steady = self._was_steady and not (self._explore_left or self._probe_left or self._resume_k is not None)
        if not steady or key != self._priced_key or self._priced_age >= REPRICE_EVERY - 1:
            self._priced, self._priced_key, self._priced_age = self.expected(running), key, 0
            self._priced_draft = self._draft_seconds  # could_pay's `expected` calls move _draft_seconds on
        else:
            self._priced_age += 1
        return self._priced

    def _extrapolated(self, running: list[RunningRow]) -> bool:
        """Whether no served step drafted at half to twice these rows: the prices of drafting here are the
        calibration's. Rows only: a context-length bucket as well (tried) re-explored each time a context grew
        ~1.4x, where the fitted context terms already carry the change. At 5-shot GSM8K, batch 8, MTP's
        calibration (64-token rows and one 1,024-key row, <= 5 rows) priced K = 1's step 26% high (verification
        at ~1.1 us a verified key, where 8 rows behind a shared prefix paid ~0.15 ms a row in all), so even at
        optimistic acceptance K = 1 never looked worth exploring, and "auto" ran K = 0 at 0.83x the fixed K = 1
        engine."""
        return not any(len(running) <= 2 * rows and rows <= 2 * len(running) for rows in self._drafted_rows)

    def could_pay(self, running: list[RunningRow], rate_k0: float) -> bool:
        """Whether some K >= 1 beats K = 0's rate by the switch margin at optimistic acceptance (EXPLORE_OPTIMISM;
        the drafter's fill rates as estimated): what an exploration could plausibly find."""
        key = (tuple((r.request_id, r.num_new_tokens > 1, r.num_tokens // 256) for r in running),
               self.target.num_fits, self.draft.num_fits, self.accept.version, self.fill.version)
        if key != self._optimistic_key or self._optimistic_age >= REPRICE_EVERY - 1:
            self._optimistic = self.expected(running, optimism=EXPLORE_OPTIMISM)
            self._optimistic_key, self._optimistic_age = key, 0
        else:
            self._optimistic_age += 1
        emitted, seconds = self._optimistic[0], self._optimistic[1].copy()
        # the first step of an exploration pays the catch-up, spread over its steps: two, or as many as it takes to
        # verify MIN_EXPLORED_DRAFTS first drafts (_extends: ~9 at batch 1)
        steps = 1 + min(max(-(-MIN_EXPLORED_DRAFTS // max(len(running), 1)), 1), 1 + 2 * MAX_THIN_EXTENSIONS)
        seconds[1:] += self._catch_up_s(running) / steps
        return bool((emitted[1:] / np.maximum(seconds[1:], 1e-9)).max() >= (1 + self.switch_margin) * rate_k0)

    def _stays_worth_catch_up(self, running: list[RunningRow], emitted: np.ndarray, seconds: np.ndarray, k: int,
                              margin: float) -> bool:
        """Whether drafting at K still beats K = 0 by the margin with MTP's catch-up (every deferred step 0, paid by
        the switch's first step) spread over the steps the switch can last: the rows' tokens left (their median)
        over what a step at K emits a row, at most CATCH_UP_HORIZON. A batch's tail of 30 rows, ~57 deferred tokens
        each and ~6 tokens to go, switched to K = 1 and paid ~150 ms of catch-up for 4-5 steps of ~20 ms (GSM8K
        batch 64: one round 20% slower)."""
        catch_up = self._catch_up_s(running)
        if not catch_up:
            return True
        decode = [r.tokens_left for r in running if r.num_new_tokens <= 1]
        per_row = emitted[k] / max(len(decode), 1)
        horizon = min(max(float(np.median(decode)) / max(per_row, 1.0), 1.0) if decode else 1.0, CATCH_UP_HORIZON)
        rate0 = emitted[0] / max(seconds[0], 1e-9)
        return emitted[k] / (seconds[k] + catch_up / horizon) >= (1 + margin) * rate0

    def _catch_up_s(self, running: list[RunningRow]) -> float:
        """Predicted seconds of the catch-up the next drafting step runs: step 0 over every running row's deferred
        tokens, each against about its row's context (0 where the catch-up is cheap: DSpark's is a projection).
        Left out of `expected` (a switch that stays pays it once), it is what an exploration at ~8k keys, batch 8,
        costs MTP: its K = 1 step priced 80 ms and measured 108 ms after 16 steps at K = 0."""
        if not (self.costly_catch_up and self._deferred):
            return 0.0
        tokens = keys = 0.0
        for r in running:
            n = self._deferred.get(r.request_id, 0)
            tokens, keys = tokens + n, keys + n * r.num_tokens
        features = np.zeros(len(DRAFT_TERMS))
        features[DRAFT_TERMS.index("per_token")], features[DRAFT_TERMS.index("per_token_context")] = tokens, keys
        return self.draft.predict(features)

    def expected(self, running: list[RunningRow], optimism: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(expected emitted tokens, predicted seconds) of the next step at each K = 0..K_max, [K_max + 1] each;
        `optimism`: each acceptance estimate moved that share of the way to 1 (1: every draft accepted).
        Vectorised over the rows (the plain per-row sum is tests/test_spec_policy.py's reference): at batch 64 a
        per-row loop cost ~3 ms a step, a few % of the step it chooses for."""
        decode = [r for r in running if r.num_new_tokens <= 1]
        prompt_tokens = sum(r.num_new_tokens for r in running if r.num_new_tokens > 1)  # cost independent of K
        prompt_keys = sum(attended_keys(r.num_new_tokens, r.num_tokens - r.num_new_tokens)
                          for r in running if r.num_new_tokens > 1)
        long_prompt = any(r.num_new_tokens > self.max_deferred_tokens for r in running)  # runs step 0 at K = 0
        ids = [r.request_id for r in decode]
        context_list = [r.num_tokens for r in decode]
        num_rows, num_decode, per_row = len(running), len(decode), float(sum(context_list))
        # a key that several rows read through shared blocks counts once (cost_model.duplicate_keys)
        dup = duplicate_keys_of(shared_blocks([r.block_ids for r in decode]), context_list, self.block_size)
        # keys read: every row's context once (a prompt chunk's start + n, a decode row's context and its drafts)
        read = sum(r.num_tokens for r in running) - (
            dup if num_decode == num_rows else duplicate_keys(((r.block_ids, r.num_tokens) for r in running),
                                                              self.block_size))
        # Per row, only sums over rows are priced: with cf = cumprod(fill) and cfa = cumprod(fill * accept) [R, K_max],
        # a row asked for K drafts proposes sum_{j<=K} cf_j and emits 1 + sum_{j<=K} cfa_j (expected_lengths_by_k);
        # so the rows' totals at every K are cumulative sums of column sums: a few numpy calls whatever R is
        verifying = verifying_context = 0.0
        drafts_by_pos, emitted_by_pos, keys_by_pos = [0.0] * self.max_k, [0.0] * self.max_k, [0.0] * self.max_k
        if decode:
            context = np.array(context_list, dtype=np.float64)  # [R]
            fill = self.fill.estimates(ids)  # [R, K_max]
            accept = self.accept.estimates(ids)  # [R, K_max]
            if optimism:
                accept = accept + optimism * (1.0 - accept)
            cf = np.cumprod(fill, axis=1)  # [R, K_max]
            drafts_by_pos = cf.sum(axis=0).tolist()  # [K_max] expected j-th drafts over rows
            emitted_by_pos = np.cumprod(fill * accept, axis=1).sum(axis=0).tolist()  # [K_max] accepted j-th drafts
            keys_by_pos = (context @ cf).tolist()  # [K_max] keys the j-th drafts attend (their row's context)
            verifying = drafts_by_pos[0]  # rows that verify a draft (fill of the first)
            verifying_context = float(context @ fill[:, 0]) - dup * verifying / num_decode
        # every K at once, in Python floats (K_max + 1 values; as numpy vectors the ~40 small calls cost ~0.15 ms a
        # choice at batch 1): StepShape.target_features and .draft_features for K = 0..K_max, priced by their fits
        target_coef, draft_coef = self.target.coef.tolist(), self.draft.coef.tolist()
        first_context = per_row - dup if self.first_reads_shared_once else per_row
        step0_always = long_prompt or not self.defers_step0  # K = 0 defers step 0 where the drafter can
        num_emitted, seconds, draft_seconds = [], [], []
        draft_tokens = emitted_past = drafted_keys = 0.0
        for k in range(self.max_k + 1):
            if k:
                draft_tokens += drafts_by_pos[k - 1]
                emitted_past += emitted_by_pos[k - 1]
                drafted_keys += keys_by_pos[k - 1]
            drafting = 1.0 if k else 0.0
            tokens = float(round(prompt_tokens + num_decode + draft_tokens))  # whole tokens, as StepShape counts
            keys = prompt_keys + per_row + drafted_keys
            emitted = num_decode + emitted_past
            # StepShape.target_features' terms: tokens and emitted tokens past a plain decode's
            target = (1.0, num_rows, tokens - num_rows, keys, verifying * drafting, verifying_context * drafting,
                      max(emitted - num_decode, 0.0), read + draft_tokens)
            step0 = 1.0 if k or step0_always else 0.0
            decodes = max(k - 1, 0)
            draft = (step0, tokens * step0, keys * step0, drafting, num_decode * drafting, first_context * drafting,
                     decodes, num_decode * decodes, per_row * decodes)
            draft_s = sum(c * x for c, x in zip(draft_coef, draft, strict=True))
            num_emitted.append(emitted)
            draft_seconds.append(draft_s)
            seconds.append(sum(c * x for c, x in zip(target_coef, target, strict=True)) + draft_s)
        self._draft_seconds = np.array(draft_seconds)  # [K_max + 1] (the same at any optimism: drafts, not accepts)
        return np.array(num_emitted), np.array(seconds)

    def _commit(self, k: int, predicted: float) -> int:
        self.chosen[k] += 1
        self._last_k = k
        self._pending_prediction = predicted
        return k

    # -- learning ------------------------------------------------------------------------------------------------
    def record_step(self, plan: StepPlan, output: StepOutput, step_s: float, draft_s: float,
                    calibration: bool = False) -> None:
        """A step ran: `step_s` its whole wall time on rank 0, `draft_s` the drafter's share of it. A calibration
        step (synthetic, at start-up) teaches the cost models as a prior (LinearCostModel.observe_prior) and no
        acceptance. A step of a held K = 0 decision has no verification to learn acceptance from."""
        held = self._held and not calibration
        if self._unobserved and not calibration:
            self._unobserved -= 1
        else:
            self._observe_costs(plan, output, step_s, draft_s, calibration)
        step0 = STEP0_DEFERRED not in output.draft_stats  # the drafter says whether it ran its per-step pass
        sampling_rows = [row for row in plan.rows if row.sampling is not None]
        if plan.num_spec_tokens and not calibration:
            self._drafted_rows.add(len(sampling_rows))
            self._unserved_ks.difference_update(range(plan.num_spec_tokens + 1))
        emitted = [len(ids) for ids in output.sampled_token_ids[: len(sampling_rows)]]
        if self.costly_catch_up:  # tokens each request has deferred since its step 0 last ran
            for row, n in zip(sampling_rows, emitted, strict=True):
                if step0:
                    self._deferred.pop(row.request_id, None)
                else:
                    self._deferred[row.request_id] = self._deferred.get(row.request_id, 0) + n
        if not calibration:
            self.realised_emitted += sum(emitted)
            if not held:  # a held step verified nothing and proposed nothing: no rate moves
                if self._exploring:  # the verifications of an exploration's steps (its verdict rests on them)
                    for row, n in zip(sampling_rows, emitted, strict=True):
                        if row.num_draft_tokens:
                            self._explored[0] += n > 1
                            self._explored[1] += 1
                ids = [row.request_id for row in sampling_rows]
                self.accept.observe_rows(ids, [row.num_draft_tokens for row in sampling_rows],
                                         [n - 1 for n in emitted])
                proposed = [len(d) for d in output.draft_token_ids] if output.draft_token_ids else [0] * len(ids)
                self.fill.observe_rows(ids, [plan.num_spec_tokens] * len(ids), proposed[: len(ids)])
                self.accept.end_step()
                self.fill.end_step()
            if self._pending_prediction is not None:
                self.predicted_emitted += self._pending_prediction
        self._pending_prediction = None
        self.free(plan.finished_request_ids)

    def _observe_costs(self, plan: StepPlan, output: StepOutput, step_s: float, draft_s: float,
                       calibration: bool) -> None:
        """The step's target and draft seconds into the fits."""
        shape = step_shape(plan, output, self.block_size)
        observe_target = self.target.observe_prior if calibration else self.target.observe
        observe_draft = self.draft.observe_prior if calibration else self.draft.observe
        observe_target(shape.target_features(), max(step_s - draft_s, 0.0))
        step0 = STEP0_DEFERRED not in output.draft_stats
        if step0 or plan.num_spec_tokens:  # else no draft term is exercised (the features are all zero): no fit
            # MTP's catch-up ran step 0 over deferred tokens too: they are step-0 tokens of this step's draft pass
            caught_up = output.draft_stats.get("catch_up_tokens", 0.0)
            draft_shape = shape if not caught_up else dataclasses.replace(
                shape, num_tokens=shape.num_tokens + round(caught_up),
                num_keys=shape.num_keys + output.draft_stats.get("catch_up_keys", 0.0))
            observe_draft(draft_shape.draft_features(plan.num_spec_tokens, step0, self.first_reads_shared_once),
                          draft_s)

    def free(self, request_ids: list[str]) -> None:
        if request_ids:
            self._hold_left = 0  # the held rows changed (a new request may take a finished one's place)
        self.accept.free(request_ids)
        self.fill.free(request_ids)
        for rid in request_ids:
            self._deferred.pop(rid, None)

    # -- reporting -----------------------------------------------------------------------------------------------
    def metrics(self) -> list[Metric]:
        costs = [Gauge(f"tandem:spec_policy_target_cost_{name}_seconds", v) for name, v in self.target.named().items()]
        costs += [Gauge(f"tandem:spec_policy_draft_cost_{name}_seconds", v) for name, v in self.draft.named().items()]
        return [
            Vector("tandem:spec_policy_chosen_k", self.chosen.tolist(), label="k"),
            Counter("tandem:spec_policy_predicted_emitted_tokens", self.predicted_emitted),
            Counter("tandem:spec_policy_realised_emitted_tokens", self.realised_emitted),
            Vector("tandem:spec_policy_acceptance_per_pos", self.accept.global_estimate().tolist(), kind="gauge"),
            *costs,
        ]


def step_shape(plan: StepPlan, output: StepOutput, block_size: int = 16) -> StepShape:
    # one pass over the rows (at batch 32 six passes and a call a row cost ~70 us of every step's record)
    tokens, keys, all_sample = 0, 0.0, True
    blocks: list[Sequence[int]] = []  # of the sampling rows
    contexts: list[int] = []  # of the sampling rows
    verifying: list[int] = []  # sampling rows (index into contexts) that verify drafts
    starts: list[int] = []  # their first verified position, num_computed_tokens + 1
    for r in plan.rows:
        n, start = len(r.token_ids), r.num_computed_tokens
        tokens += n
        keys += n * start + n * (n + 1) / 2  # attended_keys(n, start)
        if r.sampling is None:
            all_sample = False
            continue
        if r.num_draft_tokens:
            verifying.append(len(contexts))
            starts.append(start + 1)
        blocks.append(r.block_ids)
        contexts.append(start + n)
    shared = shared_blocks(blocks)  # one comparison a row serves every context below
    per_row = sum(contexts)
    context = per_row - duplicate_keys_of(shared, contexts, block_size)
    verifying_context = sum(starts) - (
        duplicate_keys_of(shared, starts, block_size) if len(verifying) == len(contexts) else
        duplicate_keys(((blocks[i], n) for i, n in zip(verifying, starts, strict=True)), block_size))
    emitted = sum(map(len, output.sampled_token_ids))
    # keys read: every row's context once; at a decode step every row samples, and that is `context` again
    read = context if all_sample else sum(r.num_computed_tokens + len(r.token_ids) for r in plan.rows) - \
        duplicate_keys(((r.block_ids, r.num_computed_tokens + len(r.token_ids)) for r in plan.rows), block_size)
    return StepShape(len(plan.rows), tokens, keys, len(contexts), context, len(verifying), verifying_context,
                     emitted, read, per_row)
