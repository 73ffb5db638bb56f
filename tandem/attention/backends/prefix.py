"""The shared core of the paged backends: write this step's K/V, then attend over each row's
causal prefix gathered from the cache (one padded SDPA call per prefix group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.metadata import AttentionMetadata, gather_rows


def write_kv(cache_flat: torch.Tensor, new: torch.Tensor, meta: AttentionMetadata) -> None:
    # cache_flat: [num_slots, ...]; new: [num_tokens, ...]
    if meta.write_rows.numel():
        cache_flat[meta.write_slots] = new[meta.write_rows].to(cache_flat.dtype)


def prefix_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor | None, meta: AttentionMetadata,
                     scale: float, value_dims: int | None = None) -> torch.Tensor:
    """q: [T, Hq, Dk]; k_flat: [num_slots, Hkv, Dk]; v_flat: [num_slots, Hkv, Dv] -> [T, Hq, Dv].
    `value_dims` instead of v_flat: the values are the keys' first value_dims channels (MLA's latent cache),
    so each group gathers its rows once, not twice (decode attention here is bound by that copy)."""
    dv = value_dims if v_flat is None else v_flat.shape[-1]
    assert dv is not None
    groups = meta.groups
    out = None if len(groups) == 1 and groups[0].covers_all(q.shape[0]) else q.new_zeros(q.shape[0], q.shape[1], dv)
    for g in groups:
        kg = gather_rows(k_flat, g.kv_slots).to(q.dtype)  # [G, S, Hkv, Dk]
        vg = kg[..., :dv] if v_flat is None else gather_rows(v_flat, g.kv_slots).to(q.dtype)  # [G, S, Hkv, Dv]
        qg = q.view(*g.token_idx.shape, *q.shape[1:]) if out is None else gather_rows(q, g.token_idx)
        og = grouped_sdpa(qg, kg, vg, g.mask, scale, g.blocked)  # [G, Q, Hq, Dv]
        if out is None:  # one dense group: its output is the whole output, in order
            return og.flatten(0, 1)
        out[g.token_idx[g.token_valid]] = og[g.token_valid]
    assert out is not None
    return out


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 blocked: torch.Tensor | None) -> torch.Tensor:
    """q: [G, Q, Hq, Dk]; k: [G, S, Hkv, Dk]; v: [G, S, Hkv, Dv]; mask: [G, 1, Q, S] -> [G, Q, Hq, Dv].
    `blocked`: ~mask, as the metadata precomputed it once a step (None: nothing is masked).

    The r = Hq / Hkv query heads that share a KV head are folded into the query axis ([G, Hkv, r * Q, Dk], the
    mask tiled r times): SDPA's own enable_gqa path on CPU is ~20x slower for decodes, and MLA's absorbed
    decode is MQA with r = every head."""
    G, Q, hq, _ = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    qf = q.view(G, Q, hkv, r, -1).permute(0, 2, 3, 1, 4).reshape(G, hkv, r * Q, -1)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, Hkv, S, D*]
    if r * Q <= SMALL_QUERY_ROWS:
        # Decodes and verification rows: two batched matmuls beat CPU SDPA's kernel ~5x at a few query rows
        # (every query row sees at least one key, so no row is all -inf).
        scores = torch.matmul(qf, k.transpose(-1, -2)).mul_(scale)  # [G, Hkv, r * Q, S]
        if blocked is not None:  # the r heads of a KV head share the mask: broadcast it, no tiling
            scores.view(G, hkv, r, Q, -1).masked_fill_(blocked.unsqueeze(2), float("-inf"))
        out = torch.matmul(scores.softmax(-1), v)
    else:
        mask = mask.repeat(1, 1, r, 1) if r > 1 else mask
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    return out.view(G, hkv, r, Q, -1).permute(0, 3, 1, 2, 4).reshape(G, Q, hq, -1)


SMALL_QUERY_ROWS = 64


