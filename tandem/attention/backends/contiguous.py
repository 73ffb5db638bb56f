"""CONTIGUOUS_SDPA / CONTIGUOUS_MLA: attention over [the request's cached prefix from earlier steps |
this step's own new K/V], causal inside the new part — the split that varlen flash kernels use.

These backends do NOT support PCP, and say so: a row's new keys come from the K/V tensor of the
row itself, which assumes a request's new tokens of the step sit contiguously on one rank. A PCP
segment (e.g. chunks 0 and 3 of a prompt on rank 0) would miss the other ranks' new tokens.
The cache is still written (for later steps), but this step's tokens are never read back from it.
"""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import gather_rows, grouped_sdpa, write_kv
from tandem.attention.metadata import AttentionMetadata, row_groups
from tandem.attention.mla import MLAUpProjection, absorb, up_project


def cached_prefix_plus_new_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                     k_flat: torch.Tensor, v_flat: torch.Tensor, meta: AttentionMetadata,
                                     scale: float) -> torch.Tensor:
    """q: [T, Hq, Dk]; k_new/v_new: [T, Hkv, D*] aligned with q; k_flat/v_flat: [num_slots, Hkv, D*] cache."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_flat.shape[-1])
    for g in row_groups(meta):  # whole rows: a row's new keys come from its own new tokens
        context_len = meta.positions[g.token_idx[:, 0]]  # [G] first new position = tokens cached before
        s = g.kv_slots.shape[1]
        in_context = torch.arange(s, device=q.device)[None, :] < context_len[:, None]  # [G, S]
        q_off = torch.arange(g.token_idx.shape[1], device=q.device)
        causal_new = (q_off[None, :, None] >= q_off[None, None, :]) & g.token_valid[:, None, :]  # [G, Q, Q]
        mask = torch.cat((in_context[:, None, :].expand(-1, q_off.shape[0], -1), causal_new), dim=-1)
        keys = torch.cat((gather_rows(k_flat, g.kv_slots).to(q.dtype), gather_rows(k_new, g.token_idx)), dim=1)
        values = torch.cat((gather_rows(v_flat, g.kv_slots).to(q.dtype), gather_rows(v_new, g.token_idx)), dim=1)
        og = grouped_sdpa(q[g.token_idx], keys, values, mask.unsqueeze(1), scale)  # [G, Q, Hq, Dv]
        out[g.token_idx[g.token_valid]] = og[g.token_valid]
    return out


@register_backend
class ContiguousSDPABackend(AttentionBackend):
    name = "CONTIGUOUS_SDPA"
    kinds = ("full_attention",)

    @classmethod
    def supports_pcp(cls) -> bool:
        return False  # new keys come from the row's own K/V, which a PCP segment does not fully hold

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert v is not None
        k_flat, v_flat = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
        out = cached_prefix_plus_new_attention(q, k, v, k_flat, v_flat, meta, scale)
        write_kv(k_flat, k, meta)
        write_kv(v_flat, v, meta)
        return out


@register_backend
class ContiguousMLABackend(AttentionBackend):
    name = "CONTIGUOUS_MLA"
    kinds = ("mla_attention",)

    @classmethod
    def supports_pcp(cls) -> bool:
        return False  # as CONTIGUOUS_SDPA: the step's new latents are taken from the row itself

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, kv_lora_rank + rope_dim)

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, up: MLAUpProjection) -> torch.Tensor:
        # absorbed everywhere: q [T, H, L + R]; entries: [T, L + R] new latents whose first L are kv_c -> [T, H, v]
        lora = up.w_uk.shape[-1]
        cache_flat = kv_cache.flatten(0, 1)  # [num_slots, L + R]
        lat = cache_flat.unsqueeze(1)
        new = entries.unsqueeze(1)
        o_latent = cached_prefix_plus_new_attention(absorb(q_nope, q_pe, up), new, new[..., :lora], lat,
                                                    lat[..., :lora], meta, scale)
        write_kv(cache_flat, entries, meta)
        return up_project(o_latent, up)
