"""PAGED_MLA: multi-head latent attention over a paged latent cache
[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] holding kv_c (normed) then k_pe (rotated).

The step's latents are written first, then every group reads its causal prefix back from the cache: short
rows (decodes, verification rows) absorbed — MQA with one shared key [kv_c | k_pe] and value kv_c — and
prompt-chunk query blocks expanded into per-head keys and values (tandem/attention/mla.py).
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import prefix_attention, write_kv
from tandem.attention.metadata import SHORT_ROW_TOKENS, AttentionMetadata
from tandem.attention.mla import MLAUpProjection, absorb, expanded_group_attention, up_project


@register_backend
class PagedMLABackend(AttentionBackend):
    name = "PAGED_MLA"
    kinds = ("mla_attention",)

    @classmethod
    def supports_pcp(cls) -> bool:
        return True  # every row's prefix is read back from the cache after the write

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, kv_lora_rank + rope_dim)

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, up: MLAUpProjection) -> torch.Tensor:
        # q_nope: [T, H, nope]; q_pe: [T, H, rope]; entries: [T, L + rope] this step's latents -> [T, H, v]
        cache_flat = kv_cache.flatten(0, 1)  # [num_slots, L + R]
        write_kv(cache_flat, entries, meta)
        lora = up.w_uk.shape[-1]
        out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], up.w_uv.shape[1])
        short = [g for g in meta.groups if g.token_idx.shape[1] <= SHORT_ROW_TOKENS]
        if short:
            lat = cache_flat.unsqueeze(1)  # [num_slots, 1, L + R]
            sub = meta if len(short) == len(meta.groups) else dataclasses.replace(meta, groups=short)
            o_latent = prefix_attention(absorb(q_nope, q_pe, up), lat, None, sub, scale, value_dims=lora)  # [T, H, L]
            if len(meta.groups) == 1 and short[0].covers_all(q_nope.shape[0]):  # a batch of decodes, in order
                return up_project(o_latent, up)
            rows = torch.cat([g.token_idx[g.token_valid] for g in short])
            out[rows] = up_project(o_latent[rows], up)
        for g in meta.groups:
            if g.token_idx.shape[1] > SHORT_ROW_TOKENS:
                out[g.token_idx[g.token_valid]] = expanded_group_attention(
                    q_nope, q_pe, cache_flat, g, scale, up)[g.token_valid]
        return out
