"""PAGED_SDPA: GQA/MHA over a paged K/V cache [2, num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import paged_metadata, prefix_attention, write_kv
from tandem.attention.batch import AttentionBatch
from tandem.attention.metadata import AttentionMetadata
from tandem.attention.sharded_kv import (
    ShardedAttentionMetadata,
    grouped_owned_attention,
    owned_attention,
    sharded_partials,
)


@register_backend
class PagedSDPABackend(AttentionBackend):
    name = "PAGED_SDPA"
    kinds = ("full_attention",)

    @classmethod
    def supports_pcp(cls) -> bool:
        return True  # every row's prefix is read back from the cache after the write

    @classmethod
    def supports_kv_sharding(cls) -> bool:
        return True

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> AttentionMetadata | ShardedAttentionMetadata:
        return paged_metadata(cls, batch)  # the CPU plan (metadata.py), or the owned keys under sharded KV

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        assert v is not None
        k_flat = kv_cache[0].flatten(0, 1)  # [num_slots, Hkv, D]
        v_flat = kv_cache[1].flatten(0, 1)
        write_kv(k_flat, k, meta)
        write_kv(v_flat, v, meta)
        return prefix_attention(q, k_flat, v_flat, meta, scale)

    @staticmethod
    def forward_sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta: ShardedAttentionMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T_global, Hq, D]; k, v: [num gathered, Hkv, D] -> partial over the owned keys
        k_flat = kv_cache[0].flatten(0, 1)  # [num_local_slots, Hkv, D]
        v_flat = kv_cache[1].flatten(0, 1)
        write_kv(k_flat, k, meta)
        write_kv(v_flat, v, meta)
        dv = v_flat.shape[-1]
        return sharded_partials(meta, q, lambda row, qr: owned_attention(qr, k_flat, v_flat, row, scale, dv), dv,
                                lambda g: grouped_owned_attention(q, k_flat, v_flat, g, scale, dv))
