"""Batched speculative-decoding verification: greedy prefix matching or lossless rejection sampling of each
request's K_i drafts against the processed target distribution, plus one recovered or bonus token per request.

Randomness is keyed like `tandem.layers.sampler`: the acceptance uniform of the draft at position p is
keyed_uniform(seed, p, 1, stream=1); the token sampled at position p (recovered, bonus, or K_i = 0) is the
exponential race over keyed_uniform(seed, p, V) (stream 0), so K_i = 0 reproduces `sample()` exactly.
Drafters that sample must draw on DRAFT_STREAM: a draft raced on the same keys as its own recovery is correlated
with it, and the output stops being distributed as the target.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem import native
from tandem.layers.sampler import SamplingMetadata, keyed_uniform, processed_probs

ACCEPT_STREAM = 1  # keyed_uniform stream of the acceptance uniforms; token sampling is stream 0
DRAFT_STREAM = 2  # keyed_uniform stream for drafters' own sampling, independent of verification's draws


def rejection_sample(
    target_logits: torch.Tensor,  # [sum_i (K_i + 1), V] float32, raw target logits, K_i + 1 rows per request
    draft_token_ids: torch.Tensor,  # [sum_i K_i] int64
    draft_probs: torch.Tensor | None,  # [sum_i K_i, V] distribution each draft was sampled from; None = one-hot
    num_draft_tokens: list[int],  # K_i per request, 0 allowed
    meta: SamplingMetadata,  # one row per request; positions = position of the request's first sampled token
) -> tuple[list[list[int]], list[int]]:
    """Emitted tokens per request (accepted drafts + 1) and the number of accepted drafts per request.

    Index math, worked for K = [2, 0, 1] (D = 3 drafts, T = 6 target rows):
        target rows   r0 r1 r2 | r3 | r4 r5     target_start = [0, 3, 4]
        draft rows    d0 d1    |    | d2        draft_start  = [0, 2, 2], req_of_draft = [0, 0, 2]
    Draft d is checked against target row d + req_of_draft[d] (each earlier request adds one bonus row):
    d0 -> r0, d1 -> r1, d2 -> r4. Row r of request i sits at position positions[i] + r - target_start[i].
    """
    _check_shapes(target_logits, draft_token_ids, draft_probs, num_draft_tokens, meta)
    if meta.all_greedy:
        return _greedy_prefix_match(native.greedy_tokens(target_logits).tolist(), draft_token_ids.tolist(),
                                    num_draft_tokens)
    device, vocab = target_logits.device, target_logits.shape[-1]
    num_reqs, num_drafts = len(num_draft_tokens), draft_token_ids.shape[0]
    num_draft = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [R]
    draft_start = num_draft.cumsum(0) - num_draft  # [R]
    target_start = draft_start + torch.arange(num_reqs, device=device)  # [R]
    req_of_draft = torch.arange(num_reqs, device=device).repeat_interleave(num_draft, output_size=num_drafts)  # [D]
    draft_rows = torch.arange(num_drafts, device=device) + req_of_draft  # [D] target row of each draft

    target_argmax = native.greedy_tokens(target_logits)  # [T]
    accepted = draft_token_ids == target_argmax[draft_rows]  # [D], the greedy rule
    probs = None
    if not meta.all_greedy:
        row_meta = _expand_to_rows(meta, num_draft + 1, target_start, target_logits.shape[0])
        probs = processed_probs(target_logits, row_meta)  # [T, V] float32; only gathered rows go to float64
        p_x = probs[draft_rows].gather(-1, draft_token_ids[:, None])[:, 0].double()  # [D]
        q_x = (draft_probs.gather(-1, draft_token_ids[:, None])[:, 0].double() if draft_probs is not None
               else torch.ones_like(p_x))  # [D]
        u = keyed_uniform(row_meta.seeds[draft_rows], row_meta.positions[draft_rows], 1, ACCEPT_STREAM)[:, 0]
        # accept with probability min(1, p(x)/q(x)); u*q < p is the same test and defined when q(x) = 0
        accepted = torch.where(row_meta.temperature[draft_rows] > 0, u * q_x < p_x, accepted)

    num_accepted = _num_accepted(accepted, req_of_draft, draft_start, num_reqs, max(num_draft_tokens, default=0))
    final_rows = target_start + num_accepted  # [R] target row of the one token each request samples
    final = target_argmax[final_rows]  # [R]
    if probs is not None:
        final = torch.where(meta.temperature > 0, _sample_final(
            probs[final_rows].double(), num_accepted < num_draft, draft_start + num_accepted,
            draft_token_ids, draft_probs, meta.seeds, meta.positions + num_accepted, vocab), final)

    drafts, counts, finals = draft_token_ids.tolist(), num_accepted.tolist(), final.tolist()
    starts = draft_start.tolist()
    emitted = [drafts[s:s + n] + [t] for s, n, t in zip(starts, counts, finals, strict=True)]
    return emitted, counts


def _greedy_prefix_match(argmax: list[int], drafts: list[int],
                         num_draft_tokens: list[int]) -> tuple[list[list[int]], list[int]]:
    """The greedy rule on host lists (rejection_sample's index math, without a tensor op a request): request i's
    drafts are accepted while each equals the target's argmax at its row; it then emits the argmax after them."""
    emitted, counts = [], []
    d = t = 0  # request i's first draft and first target row
    for k in num_draft_tokens:
        n = 0
        while n < k and drafts[d + n] == argmax[t + n]:
            n += 1
        emitted.append(drafts[d:d + n] + [argmax[t + n]])
        counts.append(n)
        d, t = d + k, t + k + 1
    return emitted, counts


def _sample_final(
    dist: torch.Tensor,  # [R, V] float64, target distribution at each request's final row
    rejected: torch.Tensor,  # [R] bool, the final token replaces a rejected draft
    rejected_draft: torch.Tensor,  # [R] int64 draft index of that draft (out of range when not rejected)
    draft_token_ids: torch.Tensor,  # [D] int64
    draft_probs: torch.Tensor | None,  # [D, V]
    seeds: torch.Tensor,  # [R] int64
    positions: torch.Tensor,  # [R] int64, position of the final token
    vocab: int,
) -> torch.Tensor:
    """Exponential race over p, or over the residual max(0, p - q) where the final token follows a rejection."""
    if draft_token_ids.shape[0]:
        idx = rejected_draft.clamp(max=draft_token_ids.shape[0] - 1)  # [R]
        q = (draft_probs[idx].double() if draft_probs is not None
             else torch.nn.functional.one_hot(draft_token_ids[idx], vocab).double())  # [R, V]
        residual = (dist - q).clamp(min=0)  # [R, V]; the race is scale-invariant, so it needs no normalising
        # only float rounding can leave an empty residual (p <= q everywhere means p == q); p is its limit
        dist = torch.where((rejected & (residual.sum(dim=-1) > 0))[:, None], residual, dist)
    noise = -torch.log(keyed_uniform(seeds, positions, vocab))  # [R, V] Exp(1), the same draw as sample()
    return (dist / noise).argmax(dim=-1)


def _expand_to_rows(
    meta: SamplingMetadata, rows_per_req: torch.Tensor, target_start: torch.Tensor, num_rows: int
) -> SamplingMetadata:
    """Per-request sampling parameters repeated over each request's K_i + 1 target rows, with row positions."""
    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(rows_per_req, output_size=num_rows)

    offset = torch.arange(num_rows, device=rows_per_req.device) - rep(target_start)  # [T] index within request
    return dataclasses.replace(
        meta, temperature=rep(meta.temperature), top_k=rep(meta.top_k), top_p=rep(meta.top_p),
        min_p=rep(meta.min_p), seeds=rep(meta.seeds), positions=rep(meta.positions) + offset)


def _num_accepted(
    accepted: torch.Tensor, req_of_draft: torch.Tensor, draft_start: torch.Tensor, num_reqs: int, max_k: int
) -> torch.Tensor:
    """[D] per-draft acceptance -> [R] length of each request's accepted prefix."""
    padded = torch.zeros(num_reqs, max_k, dtype=torch.int64, device=accepted.device)  # [R, max_k]
    within = torch.arange(accepted.shape[0], device=accepted.device) - draft_start[req_of_draft]  # [D]
    padded[req_of_draft, within] = accepted.long()
    # padding stays 0, so the running product stops at K_i even when every draft was accepted
    return padded.cumprod(dim=-1).sum(dim=-1)


def _check_shapes(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int], meta: SamplingMetadata,
) -> None:
    num_reqs, total = len(num_draft_tokens), sum(num_draft_tokens)
    if min(num_draft_tokens, default=0) < 0:
        raise ValueError(f"num_draft_tokens must be >= 0 per request; got {min(num_draft_tokens)}")
    if target_logits.shape[0] != total + num_reqs:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows; expected sum(K_i + 1) = {total + num_reqs} "
                         f"for {num_reqs} requests with {total} drafts")
    if draft_token_ids.shape != (total,):
        raise ValueError(f"draft_token_ids shape {tuple(draft_token_ids.shape)}; expected ({total},)")
    if draft_probs is not None and draft_probs.shape != (total, target_logits.shape[-1]):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)}; expected ({total}, "
                         f"{target_logits.shape[-1]})")
    if meta.seeds.shape[0] != num_reqs:
        raise ValueError(f"meta has {meta.seeds.shape[0]} rows; expected one per request ({num_reqs})")
