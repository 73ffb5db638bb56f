"""CONTIGUOUS_SDPA / CONTIGUOUS_MLA: attention over [the request's cached prefix from earlier steps |
this step's own new K/V], causal inside the new part — the split that varlen flash kernels use.

These backends do NOT support PCP, and say so: a row's new keys come from the K/V tensor of the
row itself, which assumes a request's new tokens of the step sit contiguously on one rank. A PCP
segment (e.g. chunks 0 and 3 of a prompt on rank 0) would miss the other ranks' new tokens.
The cache is still written (for later steps), but this step's tokens are never read back from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import grouped_sdpa, write_kv
from tandem.attention.batch import AttentionBatch
from tandem.attention.metadata import SHORT_ROW_TOKENS, PrefixGroup, gather_rows, row_groups
from tandem.attention.mla import MLAUpProjection, absorb, expanded_attention, up_project


@dataclass
class RowGroups:
    """The contiguous backends' metadata: every row whole in padded groups (metadata.row_groups), built once a step."""

    batch: AttentionBatch
    groups: list[PrefixGroup]

    @staticmethod
    def of(batch: AttentionBatch) -> RowGroups:
        return RowGroups(batch, row_groups(batch))


def _mask(g: PrefixGroup, meta: AttentionBatch) -> torch.Tensor:
    """[G, 1, Q, S + Q]: a row's cached prefix (positions before its first new token), then its new tokens
    causally."""
    context_len = meta.positions[g.token_idx[:, 0]]  # [G] first new position = tokens cached before
    s = g.kv_slots.shape[1]
    device = g.kv_slots.device
    in_context = torch.arange(s, device=device)[None, :] < context_len[:, None]  # [G, S]
    q_off = torch.arange(g.token_idx.shape[1], device=device)
    causal_new = (q_off[None, :, None] >= q_off[None, None, :]) & g.token_valid[:, None, :]  # [G, Q, Q]
    return torch.cat((in_context[:, None, :].expand(-1, q_off.shape[0], -1), causal_new), dim=-1).unsqueeze(1)


def cached_prefix_plus_new_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                     k_flat: torch.Tensor, v_flat: torch.Tensor, meta: RowGroups,
                                     scale: float) -> torch.Tensor:
    """q: [T, Hq, Dk]; k_new/v_new: [T, Hkv, D*] aligned with q; k_flat/v_flat: [num_slots, Hkv, D*] cache."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_flat.shape[-1])
    for g in meta.groups:  # whole rows: a row's new keys come from its own new tokens
        # the new K/V are stored values (kv_cache_dtype) like the cached ones: both read in q's dtype
        keys = torch.cat((gather_rows(k_flat, g.kv_slots), gather_rows(k_new, g.token_idx)), dim=1).to(q.dtype)
        values = torch.cat((gather_rows(v_flat, g.kv_slots), gather_rows(v_new, g.token_idx)), dim=1).to(q.dtype)
        mask = _mask(g, meta.batch)
        og = grouped_sdpa(q[g.token_idx], keys, values, mask, scale, ~mask)  # [G, Q, Hq, Dv]
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

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> RowGroups:
        return RowGroups.of(batch)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: RowGroups, scale: float) -> torch.Tensor:
        assert v is not None
        k_flat, v_flat = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
        out = cached_prefix_plus_new_attention(q, k, v, k_flat, v_flat, meta, scale)
        write_kv(k_flat, k, meta.batch)
        write_kv(v_flat, v, meta.batch)
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

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> RowGroups:
        return RowGroups.of(batch)

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: RowGroups, scale: float, up: MLAUpProjection) -> torch.Tensor:
        # entries: [T, L + R] this step's new latents -> [T, H, v]; short rows absorbed, prompt chunks expanded
        lora = up.w_uk.shape[-1]
        cache_flat = kv_cache.flatten(0, 1)  # [num_slots, L + R]
        out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], up.w_uv.shape[1])
        for g in meta.groups:
            latent = torch.cat((gather_rows(cache_flat, g.kv_slots).to(q_nope.dtype),
                                gather_rows(entries, g.token_idx).to(q_nope.dtype)), dim=1)  # [G, S + Q, L + R]
            if g.token_idx.shape[1] <= SHORT_ROW_TOKENS:
                q = gather_rows(absorb(q_nope, q_pe, up), g.token_idx)  # [G, Q, H, L + R]
                lat = latent.unsqueeze(2)  # [G, S + Q, 1, L + R]: MQA
                mask = _mask(g, meta.batch)
                og = up_project(grouped_sdpa(q, lat, lat[..., :lora], mask, scale, ~mask).flatten(0, 1), up)
                og = og.view(*g.token_idx.shape, *og.shape[1:])
            else:
                og = expanded_attention(gather_rows(q_nope, g.token_idx), gather_rows(q_pe, g.token_idx), latent,
                                        _mask(g, meta.batch), scale, up)
            out[g.token_idx[g.token_valid]] = og[g.token_valid]
        write_kv(cache_flat, entries, meta.batch)
        return out
