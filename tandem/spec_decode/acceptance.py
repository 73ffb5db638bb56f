"""Online per-position rates of a drafter: per request, shrunk toward a running global estimate per position.

A rate at position j is conditional: P(event at j | event at 1..j-1). Two are kept by the K policy (policy.py):
`fill` (the drafter produced a j-th draft when asked for j; n-gram often produces fewer) and `accept` (the target
accepted draft j after accepting 1..j-1). A verified row with d drafts of which a were accepted is a success at
positions 1..a and a failure at a+1 (when a < d); positions past a+1 were not tried and say nothing.

Estimate for request r at position j, with global successes/trials (s_j, n_j) decayed by `decay` per step and
the request's own (s_rj, n_rj) by `request_decay` per observation:
    g_j  = (s_j + prior_weight * g_{j-1}) / (n_j + prior_weight)          (g_0 = prior)
    p_rj = (s_rj + shrink * g_j) / (n_rj + shrink)
so a new request starts at the global estimate and moves to its own rate as its evidence outweighs `shrink`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PositionRates:
    max_positions: int
    prior: float = 0.5
    prior_weight: float = 2.0
    shrink: float = 8.0
    # evidence fades, so estimates follow text whose predictability drifts: the global counts per step that
    # brings new evidence, a request's own per observation of it. A step without drafts (K = 0) leaves the global
    # estimate as it was: decayed by time alone, 100 such steps (0.98^100 = 0.13) pulled it back to the prior,
    # every new request was priced at it, and drafting that paid by 5-10% at batch 1 looked like a loss
    decay: float = 0.98
    request_decay: float = 0.95
    global_succ: np.ndarray = field(init=False)  # [max_positions]
    global_trials: np.ndarray = field(init=False)  # [max_positions]
    per_request: dict[str, np.ndarray] = field(init=False, default_factory=dict)  # id -> [2, max_positions]
    _observed: bool = field(init=False, default=False)  # this step brought evidence
    version: int = field(init=False, default=0)  # bumped by every observation and decay: estimates may have moved

    def __post_init__(self) -> None:
        self.global_succ = np.zeros(self.max_positions)
        self.global_trials = np.zeros(self.max_positions)

    def observe(self, request_id: str, num_tried: int, num_succeeded: int) -> None:
        """Positions 1..num_succeeded succeeded; position num_succeeded + 1 failed when it was tried."""
        num_tried = min(num_tried, self.max_positions)
        if num_tried <= 0:
            return
        num_succeeded = min(num_succeeded, num_tried)
        observed = min(num_succeeded + 1, num_tried)  # positions this row says something about
        own = self.per_request.setdefault(request_id, np.zeros((2, self.max_positions)))
        own *= self.request_decay
        for counts in (own, (self.global_succ, self.global_trials)):
            counts[0][:num_succeeded] += 1
            counts[1][:observed] += 1
        self._observed = True
        self.version += 1

    def observe_rows(self, request_ids: list[str], num_tried: list[int], num_succeeded: list[int]) -> None:
        """observe() for every verified row of a step: the global counts in a few vector ops (a histogram of
        successes and of positions tried), not two slice updates a row (~0.4 ms a step at batch 32)."""
        if not any(num_tried):  # a step without drafts (K = 0): nothing observed, and no numpy call to say so
            return
        tried = np.minimum(np.asarray(num_tried, dtype=np.int64), self.max_positions)
        rows = np.flatnonzero(tried > 0)
        if not rows.size:
            return
        tried = tried[rows]
        succeeded = np.clip(np.asarray(num_succeeded, dtype=np.int64)[rows], 0, tried)
        observed = np.minimum(succeeded + 1, tried)
        width = self.max_positions + 1
        # rows with at least j + 1 successes (positions tried) add one at position j: reversed cumulative histograms
        self.global_succ += np.bincount(succeeded, minlength=width)[::-1].cumsum()[::-1][1:]
        self.global_trials += np.bincount(observed, minlength=width)[::-1].cumsum()[::-1][1:]
        decay = self.request_decay
        for i, s, o in zip(rows.tolist(), succeeded.tolist(), observed.tolist(), strict=True):
            own = self.per_request.get(request_ids[i])
            if own is None:
                own = self.per_request[request_ids[i]] = np.zeros((2, self.max_positions))
            else:
                own *= decay
            own[0, :s] += 1
            own[1, :o] += 1
        self._observed = True
        self.version += 1

    def end_step(self) -> None:
        if self._observed:
            self.global_succ *= self.decay
            self.global_trials *= self.decay
            self.version += 1
        self._observed = False

    def global_estimate(self) -> np.ndarray:
        """[max_positions] conditional rate per position over every request; each position's prior is the
        estimate at the position before it, so a position rarely tried (K above the usual) starts where its
        neighbour is rather than at an arbitrary constant, and trying it corrects it."""
        out = np.empty(self.max_positions)
        prior = self.prior
        for j in range(self.max_positions):
            w = self.prior_weight
            prior = out[j] = (self.global_succ[j] + w * prior) / (self.global_trials[j] + w)
        return out

    def estimate(self, request_id: str) -> np.ndarray:
        """[max_positions] conditional rate per position for one request."""
        return self.estimates([request_id])[0]

    def estimates(self, request_ids: list[str]) -> np.ndarray:
        """[R, max_positions] conditional rates of many requests at once (the policy asks for every running
        request each step); a request without evidence gets the global estimate."""
        g = self.global_estimate()
        blank = np.zeros((2, self.max_positions))
        own = np.stack([self.per_request.get(rid, blank) for rid in request_ids]) if request_ids \
            else np.zeros((0, 2, self.max_positions))  # [R, 2, max_positions]
        return (own[:, 0] + self.shrink * g) / (own[:, 1] + self.shrink)

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.per_request.pop(rid, None)


def expected_lengths(accept: np.ndarray, fill: np.ndarray, k: int) -> tuple[float, float]:
    """(expected emitted tokens, expected draft tokens) of one row asked for k drafts, from conditional rates
    [>= k] per position: emitted = 1 + sum_j prod_{i<=j} fill_i accept_i, drafts = sum_j prod_{i<=j} fill_i."""
    emitted, drafts = expected_lengths_by_k(accept[None, :max(k, 0)], fill[None, :max(k, 0)])
    return float(emitted[0, -1]), float(drafts[0, -1])


def expected_lengths_by_k(accept: np.ndarray, fill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rates [R, P] of R rows -> (expected emitted, expected drafts), each [R, P + 1]: column k is the row asked
    for k drafts (expected_lengths's formula for every k at once; column 0 is (1, 0))."""
    zero = np.zeros((accept.shape[0], 1))
    drafts = np.concatenate((zero, np.cumsum(np.cumprod(fill, axis=1), axis=1)), axis=1)
    emitted = 1.0 + np.concatenate((zero, np.cumsum(np.cumprod(fill * accept, axis=1), axis=1)), axis=1)
    return emitted, drafts
