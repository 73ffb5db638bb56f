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
    # counts are Python lists of max_positions floats (K_max is a handful): every observation is a few list
    # operations, where numpy's per-call overhead made a batch-1 step's two observe_rows ~0.15 ms inside the engine
    global_succ: list[float] = field(init=False)  # [max_positions]
    global_trials: list[float] = field(init=False)  # [max_positions]
    per_request: dict[str, list[list[float]]] = field(init=False, default_factory=dict)  # id -> [succ, trials]
    _observed: bool = field(init=False, default=False)  # this step brought evidence
    version: int = field(init=False, default=0)  # bumped by every observation and decay: estimates may have moved

    def __post_init__(self) -> None:
        self.global_succ = [0.0] * self.max_positions
        self.global_trials = [0.0] * self.max_positions

    def observe(self, request_id: str, num_tried: int, num_succeeded: int) -> None:
        """Positions 1..num_succeeded succeeded; position num_succeeded + 1 failed when it was tried."""
        self.observe_rows([request_id], [num_tried], [num_succeeded])

    def observe_rows(self, request_ids: list[str], num_tried: list[int], num_succeeded: list[int]) -> None:
        """observe() for every verified row of a step; rows that tried nothing (K = 0) say nothing."""
        gs, gt, decay, width = self.global_succ, self.global_trials, self.request_decay, self.max_positions
        observed = False
        for rid, tried, succeeded in zip(request_ids, num_tried, num_succeeded, strict=True):
            tried = min(tried, width)
            if tried <= 0:
                continue
            succeeded = min(max(succeeded, 0), tried)
            said = min(succeeded + 1, tried)  # positions this row says something about
            own = self.per_request.get(rid)
            if own is None:
                own = self.per_request[rid] = [[0.0] * width, [0.0] * width]
            else:
                own[0], own[1] = [x * decay for x in own[0]], [x * decay for x in own[1]]
            succ, trials = own
            for j in range(succeeded):
                succ[j] += 1.0
                gs[j] += 1.0
            for j in range(said):
                trials[j] += 1.0
                gt[j] += 1.0
            observed = True
        if observed:
            self._observed = True
            self.version += 1

    def end_step(self) -> None:
        if self._observed:
            d = self.decay
            self.global_succ = [x * d for x in self.global_succ]
            self.global_trials = [x * d for x in self.global_trials]
            self.version += 1
        self._observed = False

    def global_estimate(self) -> np.ndarray:
        """[max_positions] conditional rate per position over every request; each position's prior is the
        estimate at the position before it, so a position rarely tried (K above the usual) starts where its
        neighbour is rather than at an arbitrary constant, and trying it corrects it."""
        out = []
        prior, w = self.prior, self.prior_weight
        for succ, trials in zip(self.global_succ, self.global_trials, strict=True):
            prior = (succ + w * prior) / (trials + w)
            out.append(prior)
        return np.array(out)

    def estimate(self, request_id: str) -> np.ndarray:
        """[max_positions] conditional rate per position for one request."""
        return self.estimates([request_id])[0]

    def estimates(self, request_ids: list[str]) -> np.ndarray:
        """[R, max_positions] conditional rates of many requests at once (the policy asks for every running
        request each step); a request without evidence gets the global estimate."""
        g = self.global_estimate()
        blank = [[0.0] * self.max_positions] * 2
        own = np.array([self.per_request.get(rid, blank) for rid in request_ids]) if request_ids \
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
