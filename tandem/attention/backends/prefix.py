"""The shared core of the paged backends: write this step's K/V, then attend over each row's
causal prefix gathered from the cache (one padded SDPA call per prefix group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.metadata import AttentionMetadata


def write_kv(cache_flat: torch.Tensor, new: torch.Tensor, meta: AttentionMetadata) -> None:
    # cache_flat: [num_slots, ...]; new: [num_tokens, ...]
    if meta.write_rows.numel():
        cache_flat[meta.write_slots] = new[meta.write_rows].to(cache_flat.dtype)


def prefix_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, Dk]; k_flat: [num_slots, Hkv, Dk]; v_flat: [num_slots, Hkv, Dv] -> [T, Hq, Dv]."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_flat.shape[-1])
    gqa = q.shape[1] != k_flat.shape[1]
    for g in meta.groups:
        qg = gather_rows(q, g.token_idx).transpose(1, 2)  # [G, Hq, Q, Dk]
        kg = gather_rows(k_flat, g.kv_slots).to(q.dtype).transpose(1, 2)  # [G, Hkv, S, Dk]
        vg = gather_rows(v_flat, g.kv_slots).to(q.dtype).transpose(1, 2)  # [G, Hkv, S, Dv]
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        og = og.transpose(1, 2)  # [G, Q, Hq, Dv]
        out[g.token_idx[g.token_valid]] = og[g.token_valid]
    return out


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] for a 2-D index: index_select copies whole rows, several times faster on CPU than advanced
    indexing, which matters because every layer gathers its keys through the block table."""
    return x.index_select(0, idx.flatten()).view(*idx.shape, *x.shape[1:])
