"""TRITON_ATTN / TRITON_MLA: paged attention through one flash-style Triton kernel (tandem/attention/triton_paged.py).

Both write the step's K/V (or latents) into the paged cache, then run the kernel, which reads every row's causal
prefix in place through the block table: decodes, verification rows and prompt chunks in one launch, with the
log-sum-exp for owner-sharded KV's merge. MLA runs absorbed (MQA of [q_nope W_UK | q_pe] over the [kv_c | k_pe]
latents, values kv_c, the output up-projected by W_UV) for prompt chunks too.

On CUDA the kernel is compiled; on the CPU Triton's interpreter runs it (correct, slow: the tests' oracle path).
Selected by name only (`attention_config.backend`) until the kernels have run on a GPU (docs/gpu_check.md).
"""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import write_kv
from tandem.attention.batch import AttentionBatch
from tandem.attention.mla import MLAUpProjection, absorb, up_project
from tandem.attention.triton_paged import TritonMetadata, paged_attention, triton_metadata


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    kinds = ("full_attention",)
    automatic = False  # not yet run on a GPU; on the CPU the interpreter is an oracle's speed

    @classmethod
    def supports_pcp(cls) -> bool:
        return True  # every row's prefix is read from the cache after the (gathered) write

    @classmethod
    def supports_kv_sharding(cls) -> bool:
        return True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> TritonMetadata:
        return triton_metadata(batch)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: TritonMetadata, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T(gathered), Hkv, D] -> [T, Hq, D]
        assert v is not None
        k_flat, v_flat = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [num_slots, Hkv, D]
        write_kv(k_flat, k, meta)
        write_kv(v_flat, v, meta)
        return paged_attention(q, k_flat, v_flat, meta, scale, v_flat.shape[-1])[0]

    @staticmethod
    def forward_sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta: TritonMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T_global, Hq, D] -> (out [T_global, Hq, D] float32, lse [T_global, Hq]) over the owned keys
        k_flat, v_flat = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [num_local_slots, Hkv, D]
        write_kv(k_flat, k, meta)
        write_kv(v_flat, v, meta)
        out, lse = paged_attention(q, k_flat, v_flat, meta, scale, v_flat.shape[-1], with_lse=True)
        assert lse is not None
        return out, lse


@register_backend
class TritonMLABackend(AttentionBackend):
    name = "TRITON_MLA"
    kinds = ("mla_attention",)
    automatic = False

    @classmethod
    def supports_pcp(cls) -> bool:
        return True

    @classmethod
    def supports_kv_sharding(cls) -> bool:
        return True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, kv_lora_rank + rope_dim)

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> TritonMetadata:
        return triton_metadata(batch)

    @staticmethod
    def _absorbed(q: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMetadata, scale: float, up: MLAUpProjection,
                  with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # q: [T, H, L + rope] absorbed queries -> (o_latent [T, H, L], lse)
        lora = up.w_uk.shape[-1]
        latent = kv_cache.flatten(0, 1).unsqueeze(1)  # [num_slots, 1, L + rope]: one KV head for every query head
        return paged_attention(q, latent, latent, meta, scale, lora, rope_dim=q.shape[-1] - lora, with_lse=with_lse)

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: TritonMetadata, scale: float, up: MLAUpProjection) -> torch.Tensor:
        # q_nope: [T, H, nope]; q_pe: [T, H, rope]; entries: [T(gathered), L + rope] -> [T, H, v]
        write_kv(kv_cache.flatten(0, 1), entries, meta)
        o_latent = TritonMLABackend._absorbed(absorb(q_nope, q_pe, up), kv_cache, meta, scale, up, False)[0]
        return up_project(o_latent, up)

    @staticmethod
    def forward_mla_sharded(q: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                            meta: TritonMetadata, scale: float,
                            up: MLAUpProjection) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T_global, H, nope + rope] -> (out [T_global, H, v] float32, lse [T_global, H]) over the owned latents
        write_kv(kv_cache.flatten(0, 1), entries, meta)
        nope = up.w_uk.shape[1]
        o_latent, lse = TritonMLABackend._absorbed(absorb(q[..., :nope], q[..., nope:], up), kv_cache, meta, scale,
                                                   up, True)
        assert lse is not None
        # the up-projection is linear, so partials up-projected before the merge merge to the same output
        return up_project(o_latent.to(up.w_uv.dtype), up).float(), lse
