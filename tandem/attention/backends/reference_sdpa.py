"""REFERENCE_SDPA / REFERENCE_MLA: the plainest paged backends, a readable oracle and the template for a new one.

It needs no metadata beyond the step's batch (prepare_metadata is the default): each row writes its new K/V, then
reads its keys [0, seq_len) back through its block table and attends them with one explicit-scores call, masked by
position, keeping the log-sum-exp (the output a split-KV merge needs). One call per row: slow, obvious, correct
under PCP (every segment reads its causal prefix from the cache after the gathered write). MLA runs absorbed: MQA
over the latent cache, the values the latents' first kv_lora_rank channels. Never picked by automatic selection.
"""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.batch import AttentionBatch
from tandem.attention.kv_dtype import store_rows
from tandem.attention.mla import MLAUpProjection, absorb, up_project


def row_attention_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, Dk] at positions q_pos [n] over keys [S, Hkv, Dk] / values [S, Hkv, Dv] at positions 0..S-1
    -> (out [n, Hq, Dv], lse [n, Hq] float32); query at position p sees keys 0..p."""
    r = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(r, dim=1).transpose(0, 1).float()  # [Hq, S, Dk]
    v = values.repeat_interleave(r, dim=1).transpose(0, 1).float()  # [Hq, S, Dv]
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(1, 2)) * scale  # [Hq, n, S]
    hidden = torch.arange(keys.shape[0], device=q.device)[None, :] > q_pos[:, None]  # [n, S]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    out = torch.matmul((scores - lse[..., None]).exp(), v)  # [Hq, n, Dv]
    return out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1)


def write_new(cache_flat: torch.Tensor, new: torch.Tensor, batch: AttentionBatch) -> None:
    # cache_flat: [num_slots, ...]; new: [num rows of write_rows' tensor, ...]
    store_rows(cache_flat, batch.write_slots, new[batch.write_rows].to(cache_flat.dtype))


def row_slots(batch: AttentionBatch, row: int) -> torch.Tensor:
    """[seq_len] int64 cache slots of row `row`'s keys, positions 0..seq_len-1."""
    pos = torch.arange(int(batch.seq_lens_cpu[row]), device=batch.block_table.device)
    return batch.block_table[row, pos // batch.block_size].long() * batch.block_size + pos % batch.block_size


def rows(batch: AttentionBatch) -> list[tuple[int, slice]]:
    qsl = batch.query_start_loc_cpu.tolist()
    return [(i, slice(a, b)) for i, (a, b) in enumerate(zip(qsl[:-1], qsl[1:], strict=True)) if b > a]


@register_backend
class ReferenceSDPABackend(AttentionBackend):
    name = "REFERENCE_SDPA"
    kinds = ("full_attention",)
    automatic = False  # an oracle: chosen by name only

    @classmethod
    def supports_pcp(cls) -> bool:
        return True  # every row's keys are read back from the cache after the (gathered) write

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionBatch, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T(gathered), Hkv, D] this step's K/V -> [T, Hq, D]
        assert v is not None
        k_flat, v_flat = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [num_slots, Hkv, D]
        write_new(k_flat, k, meta)
        write_new(v_flat, v, meta)
        out = q.new_zeros(q.shape[0], q.shape[1], v_flat.shape[-1])  # graph padding stays zero
        for i, tokens in rows(meta):
            slots = row_slots(meta, i)
            out[tokens] = row_attention_with_lse(q[tokens], k_flat[slots].to(q.dtype), v_flat[slots].to(q.dtype),
                                             meta.positions[tokens], scale)[0]
        return out


@register_backend
class ReferenceMLABackend(AttentionBackend):
    name = "REFERENCE_MLA"
    kinds = ("mla_attention",)
    automatic = False

    @classmethod
    def supports_pcp(cls) -> bool:
        return True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, kv_lora_rank + rope_dim)

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionBatch, scale: float, up: MLAUpProjection) -> torch.Tensor:
        # q_nope: [T, H, nope]; q_pe: [T, H, rope]; entries: [T(gathered), L + rope] this step's latents -> [T, H, v]
        lora = up.w_uk.shape[-1]
        cache_flat = kv_cache.flatten(0, 1)  # [num_slots, L + rope]
        write_new(cache_flat, entries, meta)
        q = absorb(q_nope, q_pe, up)  # [T, H, L + rope]
        o_latent = q.new_zeros(q.shape[0], q.shape[1], lora)
        for i, tokens in rows(meta):
            latent = cache_flat[row_slots(meta, i)].to(q.dtype)[:, None]  # [S, 1, L + rope]: one shared KV head
            o_latent[tokens] = row_attention_with_lse(q[tokens], latent, latent[..., :lora], meta.positions[tokens],
                                                  scale)[0]
        return up_project(o_latent, up)
