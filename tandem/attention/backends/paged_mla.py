"""PAGED_MLA: multi-head latent attention over a paged latent cache
[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] holding kv_c (normed) then k_pe (rotated).

Queries arrive absorbed into the latent space (q_nope @ W_UK, then q_pe), so attention is MQA with
one shared key = [kv_c | k_pe] and value = kv_c; the caller up-projects the output with W_UV.
"""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import prefix_attention, write_kv
from tandem.attention.metadata import AttentionMetadata


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
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, L + R] absorbed queries; k: [T, L + R] new latent entries; v: [T, L] = kv_c (k's head)
        assert v is not None
        kv_lora_rank = v.shape[-1]
        cache_flat = kv_cache.flatten(0, 1)  # [num_slots, L + R]
        write_kv(cache_flat, k, meta)
        entries = cache_flat.unsqueeze(1)  # [num_slots, 1, L + R]
        return prefix_attention(q, entries, entries[..., :kv_lora_rank], meta, scale)
