"""Step costs fitted online: seconds of a target pass and of the draft passes as linear functions of the step's
shape, and the draft-prefill prediction for the two PCP draft modes from the target's terms (plus, for the
replicated mode, its own backend's timed cost per key).

Features of a step (all from the StepPlan, so the scheduler can evaluate a step it has not run):
    target: 1, rows, tokens past the first of each row, tokens x context (attended keys: sum over rows of
            n_i * (start_i + (n_i + 1) / 2)), verifying rows and their summed context (a row with drafts takes the
            multi-token attention path and the rejection sampler, a plain decode neither), emitted tokens past one a
            sampling row (accepted drafts: the engine's per-token output work; expected when the policy evaluates a
            step), keys read (sum over rows of start_i + n_i, shared prefix blocks once: a row's cache is read once
            a layer whatever its number of query tokens)
            A decode row's one token and one emitted token are priced by `per_row`. Counted whole, tokens and
            emitted tokens equal the rows at every K = 0 step: hundreds of such steps pinned only the sum of the
            three terms, and the ridge spread it evenly (MTP at batch 8 on GSM8K, avx2: per_token 0.212 ms and
            per_emitted_token 0.211 ms a token after a K = 0 stretch), so every K >= 1 paid those shares again for
            its drafts: K = 1 priced 21.7 ms where a fixed K = 1 engine ran ~15.6 ms a step, and "auto" never drafted
            where K = 1 paid 1.36x no-spec. (Attended keys stay whole: past the keys read they would move with the
            extra tokens at a steady context, and a K = 0 step's growing context is what tells the two apart.)
    draft:  1, tokens, attended keys                   (MTP step 0 / DSpark context: every token of the step;
                                                        0 at a decode step where MTP defers step 0, K = 0)
            [k>0], S [k>0], C [k>0]                    (first draft: sampling / DSpark's block, S rows, C keys)
            (k-1)+, S (k-1)+, C (k-1)+                 (MTP's one-token draft decodes)
where S = sampling rows and C = their summed context. A drafter whose passes lack a term fits ~0 for it.
C counts keys of shared prefix blocks once where the pass reads them once (MTP's first draft: its step 0 runs on
the target's cascade metadata) and once per row where it does not (DSpark's block attends each row's gathered
context prefix; MTP's one-token draft decodes): at ~8k keys behind one prefix, batch 8, DSpark's K = 1 step was
priced 112 ms against 140 ms measured with C counted once.
The verifying and sampling contexts count a key that several rows read through the same cache blocks (a shared
few-shot prefix, which cascade attention reads once for all of them) once (`duplicate_keys`): priced per row, the
calibration's per-key cost of one row's verification made 8 rows x ~1,000 keys over a shared 700-key prefix cost
1.5-1.8x what they did. The attended keys of the target stay per row (their cost is fitted at every step).
Attended keys are compute (a prompt chunk's n queries against its keys); keys read are memory: a decode row and
a row verifying K drafts read the same cache, and at a few query rows the absorbed attention is bound by that
read. With attended keys alone, a verifying row at ~8k keys was priced (K + 1)x a decode's keys, and the fit split
the difference: K = 0 priced ~20% low and K = 1 ~25% high where n-gram's K = 1 step measured 30.4 ms against a
plain decode's 30.9 ms.

The fit is least squares on relative error (each step weighted by 1 / seconds^2) with exponential forgetting (old
steps fade, so the model follows a machine whose load or a workload whose shape drifts), a lone high outlier
clipped once the model is fitted, a small ridge toward zero (terms the data cannot separate stay small), and
non-negative coefficients (a cost never falls as work grows).
It is re-solved every `refresh_every` steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.step_plan import attended_keys

TARGET_TERMS = ("base", "per_row", "per_extra_token", "per_token_context", "per_verifying_row",
                "per_verifying_context", "per_accepted_token", "per_key_read")
DRAFT_TERMS = ("base", "per_token", "per_token_context", "first", "first_per_row", "first_per_context",
               "decode", "decode_per_row", "decode_per_context")


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on: its rows, tokens, attended keys, and its sampling rows' count and context."""

    num_rows: int
    num_tokens: int
    num_keys: float
    num_sampling_rows: int
    sampling_context: int
    num_verifying_rows: float = 0.0
    verifying_context: float = 0.0
    num_emitted: float = 0.0
    keys_read: float = 0.0  # sum over rows of start + n, keys read through shared prefix blocks once
    sampling_context_per_row: float | None = None  # sampling_context with shared keys once per row (None: the same)

    def target_features(self) -> np.ndarray:
        """[base, rows, tokens past one a row, attended keys, verifying rows, verifying context, tokens emitted past
        one a sampling row, keys read] (TARGET_TERMS): a plain decode step (K = 0) exercises neither count past one,
        so the fit never splits a decode row's cost between terms that move together at K = 0 and apart at K >= 1
        (module docstring)."""
        return np.array([1.0, self.num_rows, self.num_tokens - self.num_rows, self.num_keys,
                         self.num_verifying_rows, self.verifying_context,
                         max(self.num_emitted - self.num_sampling_rows, 0.0), self.keys_read])

    def draft_features(self, k: int, step0: bool = True, first_reads_shared_once: bool = True) -> np.ndarray:
        """`step0`: the drafter runs its pass over every token of the step (False: MTP deferred it, K = 0);
        `first_reads_shared_once`: the first draft reads shared prefix keys once (MTP), not per row (DSpark)."""
        first, decodes, every = float(k > 0), float(max(k - 1, 0)), float(step0)
        s = self.num_sampling_rows
        per_row = self.sampling_context if self.sampling_context_per_row is None else self.sampling_context_per_row
        c = self.sampling_context if first_reads_shared_once else per_row
        return np.array([every, self.num_tokens * every, self.num_keys * every, first, s * first, c * first, decodes,
                         s * decodes, per_row * decodes])


def duplicate_keys(rows: Iterable[tuple[Sequence[int], int]], block_size: int) -> int:
    """Keys read by more than one row, counted once per extra row: rows = (block ids, context tokens). Rows whose
    tables start with the same block share their leading equal blocks (prefix-cache hits), whole blocks within
    each row's context; each row is compared with the first row of its kind."""
    rows = list(rows)
    return duplicate_keys_of(shared_blocks([blocks for blocks, _ in rows]), [context for _, context in rows],
                             block_size)


def shared_blocks(block_tables: Sequence[Sequence[int]]) -> list[int]:
    """Per row, its leading blocks equal to those of the first row of its kind (rows whose tables start with the
    same block; 0 for that first row and a row without blocks). duplicate_keys_of turns them into the keys counted
    twice at any contexts: a step prices the same rows at two or three contexts (verifying, sampling, read), and
    one comparison a row serves them all (at batch 32 the comparisons were ~30% of the policy's time)."""
    first: dict[int, tuple[Sequence[int], int]] = {}  # first block -> (first row's blocks, last common length)
    out = []
    for blocks in block_tables:
        if not blocks:
            out.append(0)
            continue
        ref = first.get(blocks[0])
        if ref is None:
            first[blocks[0]] = blocks, 0
            out.append(0)
        else:
            table, common = ref
            # the rows behind one prefix share the same length: the last row's answer, checked inline first
            if not (0 < common < len(blocks) and common < len(table) and table[common] != blocks[common]
                    and table[:common] == blocks[:common]):
                common = _common_prefix(table, blocks)
                first[blocks[0]] = table, common
            out.append(common)
    return out


def duplicate_keys_of(shared: Sequence[int], contexts: Sequence[int], block_size: int) -> int:
    """duplicate_keys from shared_blocks: each row's shared blocks that lie whole within its context."""
    return block_size * sum(min(n, context // block_size) for n, context in zip(shared, contexts, strict=True))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading equal items of a and b: one slice comparison (in C) where all are equal, else a
    bisection over slice comparisons, so an 8k-token row's 512 blocks cost ~10 comparisons, not 512 Python steps
    (shared_blocks checks the last row's answer before calling this)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


MIN_WEIGHTED_SECONDS = 1e-4  # a step's weight in the fit is 1 / seconds^2, capped here (a synthetic 0 s step)
# The start-up calibration's steps are a prior: each served step fades them by PRIOR_FADE more than its forgetting,
# down to MIN_PRIOR_SCALE (they still pin what served steps never exercise: the verification terms during a run
# of K = 0). Weighted 1 / seconds^2, 50 calibration steps of ~5 ms at 1,024 keys outweighed ~100 served steps of
# ~40 ms at ~8k keys, so the fit kept the calibration's cost per key (lower: a 1k-key cache fits the CPU's caches)
# and priced those steps ~20% low.
PRIOR_FADE = 0.9
MIN_PRIOR_SCALE = 1e-3
OUTLIER_CLIP = 1.5  # a step measured above this multiple of the prediction is counted at it (noise is one-sided)


@dataclass
class LinearCostModel:
    terms: tuple[str, ...]
    forgetting: float = 0.98
    ridge: float = 1e-4
    refresh_every: int = 8
    num_observations: int = 0
    # the last observation, when it was clipped: its weighted features and the seconds cut off
    _clipped: tuple[np.ndarray, float] | None = field(init=False, default=None)
    _free: np.ndarray | None = field(init=False, default=None)  # [F] bool the last fit's unclamped terms
    gram: np.ndarray = field(init=False)  # [F, F] sum of w x x^T over served steps
    moment: np.ndarray = field(init=False)  # [F] sum of w x y over served steps
    prior_gram: np.ndarray = field(init=False)  # [F, F] and [F]: the same over calibration steps
    prior_moment: np.ndarray = field(init=False)
    prior_scale: float = 1.0  # the prior's weight now (PRIOR_FADE per served step)
    num_fits: int = 0  # times re-solved (a caller's prices from before a fit are stale)
    coef: np.ndarray = field(init=False)  # [F] seconds per unit of each term
    # served steps not yet folded into gram and moment, oldest first: (weight, features, seconds), folded in at the
    # next refit as one product (per step, the outer product and the forgetting were ~10 small numpy ops)
    _pending: list[tuple[float, np.ndarray, float]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.terms)
        self.gram, self.moment, self.coef = np.zeros((n, n)), np.zeros(n), np.zeros(n)
        self.prior_gram, self.prior_moment = np.zeros((n, n)), np.zeros(n)

    def _fold(self) -> None:
        """gram <- f^m gram + sum_i f^(m-1-i) w_i x_i x_i^T over the m pending steps (moment alike): what m updates
        gram <- f gram + w x x^T in turn give."""
        if not self._pending:
            return
        m, f = len(self._pending), self.forgetting
        # Python floats and one array each: a handful of numpy calls per fold, not one per step
        weights = np.array([w * f ** (m - 1 - i) for i, (w, _, _) in enumerate(self._pending)])  # [m]
        x = np.array([features for _, features, _ in self._pending])  # [m, F]
        y = np.array([sec for _, _, sec in self._pending])  # [m]
        decay = f ** m
        self.gram = decay * self.gram + (x.T * weights) @ x
        self.moment = decay * self.moment + x.T @ (weights * y)
        self._pending.clear()

    def observe_prior(self, features: np.ndarray, seconds: float) -> None:
        """A calibration step: fitted like a served one, then faded faster (PRIOR_FADE); never clipped."""
        if not features.any():
            return
        weight = 1.0 / max(seconds, MIN_WEIGHTED_SECONDS) ** 2
        self.prior_gram += weight * np.outer(features, features)
        self.prior_moment += weight * features * seconds
        self.num_observations += 1
        if self.num_observations % self.refresh_every == 0:
            self.refit()

    def observe(self, features: np.ndarray, seconds: float) -> None:
        """One step's features and measured seconds. A step above OUTLIER_CLIP x the prediction counts at that
        bound (a step stalled by the machine: another process, a GC pause), but only alone: the next such step in
        a row means the model is wrong, not the machine (a term the data never exercised, e.g. draft decodes at an
        8k context fitted on the 64-token calibration, priced K = 3 at 0.6x its cost): both count in full and the
        model is re-solved at once."""
        if not features.any():  # no term can explain it (MTP's deferred step 0: a few copies), nothing to fit
            return
        bound = OUTLIER_CLIP * self.predict(features) + 1e-4
        outlier = self.ready and seconds > bound
        kept = bound if outlier else seconds
        # relative error is what ranks K (a rate ratio), so each step weighs 1 / seconds^2: unweighted, a 1.5 s
        # prompt chunk outweighed ~100 decode steps of 35 ms, and K = 0's decode was priced 48% high at 8k keys
        weight = 1.0 / max(kept, MIN_WEIGHTED_SECONDS) ** 2
        self._pending.append((weight, features, kept))
        self.prior_scale = max(self.prior_scale * PRIOR_FADE, MIN_PRIOR_SCALE)
        self.num_observations += 1
        if outlier and self._clipped is not None:  # the second in a row: this one and the last one count in full
            self._fold()
            last_features, last_excess = self._clipped
            self.moment += weight * features * (seconds - bound) + self.forgetting * last_features * last_excess
            self.refit()
        elif self.num_observations % self.refresh_every == 0:
            self.refit()
        self._clipped = (weight * features, seconds - bound) if outlier else None

    def refit(self) -> None:
        """Non-negative ridge least squares by an active set: solve on the free terms, drop the most negative; a
        dropped term whose gradient says the fit improves as it grows rejoins (the KKT check). It starts from the
        last fit's free terms: the data moves little between fits, so one solve usually settles it (starting from
        every term, a drafter with 4 unused terms paid ~5 solves, ~0.45 ms, every 8th step)."""
        self.num_fits += 1
        self._fold()
        gram = self.gram + self.prior_scale * self.prior_gram
        moment = self.moment + self.prior_scale * self.prior_moment
        n = len(self.terms)
        a_full = gram.copy()
        a_full.flat[:: n + 1] += self.ridge * (gram.diagonal() + 1e-12)  # the ridge, on the diagonal
        free = self._free.copy() if self._free is not None else np.ones(n, dtype=bool)
        tol = 1e-9 * (float(np.abs(moment).max()) + 1e-30)
        coef = np.zeros(n)
        for _ in range(3 * n):  # bounded: a term can leave and rejoin, the set cannot cycle for long
            coef = np.zeros(n)
            if free.any():
                idx = np.flatnonzero(free)
                sol = np.linalg.solve(a_full[idx[:, None], idx], moment[idx])
                if sol.min() < 0:
                    free[idx[np.argmin(sol)]] = False
                    continue
                coef[idx] = sol
            grad = moment - a_full @ coef  # -d(loss)/d(coef): > 0 where a larger coefficient fits better
            grad[free] = 0.0
            j = int(np.argmax(grad))
            if grad[j] <= tol:
                break
            free[j] = True
        self._free = free
        self.coef = coef

    def refresh(self) -> None:
        """Re-solve now where served steps came in since the last fit (else nothing changed)."""
        if self._pending:
            self.refit()

    def fade_prior(self) -> None:
        """Served steps now cover what the prior priced: let them decide at the next fit (MIN_PRIOR_SCALE)."""
        self.prior_scale = MIN_PRIOR_SCALE

    @property
    def ready(self) -> bool:
        return self.num_observations >= self.refresh_every

    def predict(self, features: np.ndarray) -> float:
        return float(features @ self.coef)

    def named(self) -> dict[str, float]:
        return dict(zip(self.terms, self.coef.tolist(), strict=True))


def fit_prefill_terms(samples: list[tuple[int, float]], chunk: int) -> LinearCostModel:
    """The target's per-token and per-attended-key terms (per_extra_token, per_token_context) from measured
    prefills (prompt length, seconds) of at least two lengths, each prefill's features its tokens and causal keys
    (draft_prefill_features' sharded ones, which the prediction prices); the per-step terms and the keys read
    (negligible against a long prefill's compute) are left out."""
    model = LinearCostModel(TARGET_TERMS, forgetting=1.0, ridge=1e-9)
    for prompt_len, seconds in samples:
        features = np.zeros(len(TARGET_TERMS))
        features[[TARGET_TERMS.index("per_extra_token"), TARGET_TERMS.index("per_token_context")]] = \
            draft_prefill_features("sharded", prompt_len, chunk)
        model.observe(features, seconds)
    model.refit()
    return model


DRAFT_MODES = ("sharded", "replicated")


def draft_prefill_features(mode: str, prompt_len: int, chunk: int) -> np.ndarray:
    """[tokens, keys] the drafter's step 0 computes over one prompt prefilled in chunks of at most `chunk` tokens.
        sharded:    keys = the causal keys (sum over chunks of n * start + n (n + 1) / 2), as the target's PCP
                    backend computes them (256-query blocks against the keys up to each block)
        replicated: keys = the dense block CONTIGUOUS_MLA computes and masks: each of a chunk's n queries against
                    the row's gathered slots up to its seq_len (start + n) and then its n new latents, so
                    sum over chunks of n * (start + 2 n)
    Both count GLOBAL tokens and keys: sharded splits them over the P ranks, replicated runs all on every rank;
    the coefficients carry that difference (draft_prefill_terms_from_target)."""
    chunks = [(start, min(chunk, prompt_len - start)) for start in range(0, prompt_len, chunk)]
    if mode == "sharded":
        keys = sum(attended_keys(n, start) for start, n in chunks)
    elif mode == "replicated":
        keys = float(sum(n * (start + 2 * n) for start, n in chunks))
    else:
        raise ValueError(f"draft mode {mode!r}: expected one of {DRAFT_MODES}")
    return np.array([float(prompt_len), keys])


def draft_prefill_terms_from_target(target: LinearCostModel, num_layers: int, pcp_size: int,
                                    replicated_per_key: float | None = None) -> dict[str, np.ndarray]:
    """[per_token, per_key] of one drafter layer in each mode, from the fitted target: a draft layer costs about
    one target layer (the target's per-token and per-token-context terms over its layers). The target is fitted
    on GLOBAL tokens of PCP-split steps, so its terms already price a rank's 1/P share of the rows plus each
    layer's latent gather: that is the sharded layer. Replicated runs every row on every rank: P times the
    per-token term, and per dense key either P times the target's per-key term (a-priori: the same attention
    kernel cost) or `replicated_per_key`, the replicated backend's own seconds per dense key as timed on every
    rank at once (benchmarks/draft_modes.py). CONTIGUOUS_MLA's cost per key is not the target's: the a-priori
    replicated prediction came out 0.27-0.38x the measured one at 8k tokens on the 2-core dev machine."""
    c = target.named()
    layer = np.array([c["per_extra_token"], c["per_token_context"]]) / max(num_layers, 1)
    replicated = pcp_size * layer
    if replicated_per_key is not None:
        replicated[1] = replicated_per_key
    return {"sharded": layer, "replicated": replicated}


def predict_draft_prefill_s(terms: dict[str, np.ndarray], prompt_len: int, chunk: int | None = None
                            ) -> dict[str, float]:
    """Seconds of the drafter's step 0 over a prompt (in chunks of `chunk` tokens) in each draft mode:
        seconds(mode) = per_token[mode] * tokens + per_key[mode] * keys(mode)     (draft_prefill_features)
    with `terms` from draft_prefill_terms_from_target."""
    return {mode: float(coef @ draft_prefill_features(mode, prompt_len, chunk or prompt_len))
            for mode, coef in terms.items()}
