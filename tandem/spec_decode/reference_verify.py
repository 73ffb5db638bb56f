"""Plain single-sequence speculative-decoding verification (gpt-fast style), kept as the oracle for
the batched `rejection_sample`: greedy prefix matching or probabilistic accept/reject with residual resampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def verify_one(
    target_probs: torch.Tensor,  # [K+1, V] float64, processed target distribution at each position
    draft_tokens: list[int],  # K draft token ids
    draft_probs: torch.Tensor | None,  # [K, V] distribution each draft was sampled from; None = one-hot drafts
    greedy: bool,
    uniforms: torch.Tensor,  # [K] acceptance uniforms in (0, 1)
    sample_fn: Callable[[torch.Tensor, int], int],  # (probs [V], position index j) -> token id
) -> list[int]:
    """Tokens emitted for one request: the accepted drafts plus one target token (1..K+1 tokens)."""
    emitted: list[int] = []
    for j, x in enumerate(draft_tokens):
        p = target_probs[j]
        if greedy:
            if x != int(p.argmax()):
                return emitted + [int(p.argmax())]
        else:
            q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(
                torch.tensor(x), p.shape[-1]).double()
            # accept with probability min(1, p(x)/q(x)); u*q < p is the same test and defined when q(x) = 0
            if not float(uniforms[j]) * float(q[x]) < float(p[x]):
                residual = (p - q).clamp(min=0)
                # only float rounding can make p <= q everywhere; then p itself is the residual's limit
                residual = residual / residual.sum() if residual.sum() > 0 else p
                return emitted + [sample_fn(residual, j)]
        emitted.append(x)
    bonus = target_probs[len(draft_tokens)]
    return emitted + [int(bonus.argmax()) if greedy else sample_fn(bonus, len(draft_tokens))]
