"""Attention of one long row (a prompt chunk) over its causal prefix, with each key read once per layer.

A long row has Q queries at positions p .. p + Q - 1 and sees keys 0 .. p + Q - 1. It is attended as two
pieces whose partial results are merged by their log-sum-exp (LSE):

    prefix    all Q queries x keys [0, p)      nothing masked
    diagonal  all Q queries x keys [p, p + Q)  causal, top-left aligned (query i sees keys p .. p + i)

so no masked score is computed outside the diagonal square, no [Q, S] mask is built, and the CPU flash kernel
skips the diagonal's upper triangle itself. Merging two attentions over disjoint key sets (LSE l1, l2):

    out = (exp(l1 - m) o1 + exp(l2 - m) o2) / (exp(l1 - m) + exp(l2 - m)),  lse = m + log(...),  m = max(l1, l2)

which is exact: softmax over the union is the LSE-weighted mix of the softmaxes over the parts.

GQA: in the prefix piece the r = Hq / Hkv query heads sharing a KV head are folded into the query axis (no
mask, so the fold is free and K/V are never repeated); in the diagonal piece, where the causal mask differs per
query, the Q diagonal keys are repeated r times (Q keys, not the whole prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, Q, D]; k: [B, H, S, D]; v: [B, H, S, Dv] -> (out [B, H, Q, Dv], lse [B, H, Q] float32).
    `causal`: query i sees keys 0..i (Q == S)."""
    dv = v.shape[-1]
    if q.device.type == "cpu":
        # The CPU flash kernel returns the LSE that F.scaled_dot_product_attention drops; it needs equal head
        # sizes, so narrower values are zero-padded (the padded output channels are exactly zero).
        if dv != q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal,
                                                                               scale=scale)[:2]
        return out[..., :dv], lse.float()
    return math_attention_with_lse(q, k, v, scale, causal)


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse by explicit scores (any device; the tests' oracle)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, H, Q, S]
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul((scores - lse[..., None]).exp().to(v.dtype), v)
    return out, lse


def merge_attn_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                      lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attentions of the same queries over two disjoint key sets: o*: [..., Q, Dv]; lse*: [..., Q]."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    total = w1 + w2
    out = (o1.float() * (w1 / total)[..., None] + o2.float() * (w2 / total)[..., None]).to(o1.dtype)
    return out, m + total.log()


def causal_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Hq, Q, D]; k: [Hkv, S, D]; v: [Hkv, S, Dv], S >= Q, the queries at the last Q key positions
    -> [Hq, Q, Dv]."""
    hq, num_q, _ = q.shape
    hkv, s, _ = k.shape
    r, p = hq // hkv, s - num_q
    kd = k[:, p:].repeat_interleave(r, dim=0) if r > 1 else k[:, p:]  # [Hq, Q, D]
    if v is k:  # MLA's absorbed form: the values are the keys, repeated once
        vd = kd
    else:
        vd = v[:, p:].repeat_interleave(r, dim=0) if r > 1 else v[:, p:]  # [Hq, Q, Dv]
    out, lse = attention_with_lse(q[None], kd[None], vd[None], scale, causal=True)  # [1, Hq, Q, Dv]
    if p == 0:
        return out[0]
    q_fold = q.reshape(hkv, r * num_q, -1)  # head h = kv * r + j: the r heads of a KV head, one after another
    o_pre, lse_pre = attention_with_lse(q_fold[None], k[None, :, :p], v[None, :, :p], scale, causal=False)
    merged, _ = merge_attn_states(out[0], lse[0], o_pre[0].reshape(hq, num_q, -1), lse_pre[0].reshape(hq, num_q))
    return merged
