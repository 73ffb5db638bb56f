"""PAGED_MLA: multi-head latent attention over a paged latent cache
[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] holding kv_c (normed) then k_pe (rotated).

The step's latents are written first, then every row reads its causal prefix back from the cache: short
rows (decodes, verification rows) absorbed — MQA with one shared key [kv_c | k_pe] and value kv_c — and long
rows (prompt chunks) expanded into per-head keys and values once per layer, or absorbed, whichever the cost
formula in tandem/attention/mla.py says is cheaper for the row's shape.
"""

from __future__ import annotations

import torch

from tandem.attention import expanded_prefix
from tandem.attention.backend import AttentionBackend, register_backend
from tandem.attention.backends.prefix import own_key_attention, paged_metadata, prefix_attention, write_kv
from tandem.attention.batch import AttentionBatch
from tandem.attention.metadata import SHORT_ROW_TOKENS, AttentionMetadata, gather_rows, select_rows
from tandem.attention.mla import (
    MLAUpProjection,
    absorb,
    expand_latents,
    long_row_attention,
    prefers_expanded,
    up_project,
)
from tandem.attention.sharded_kv import (
    OwnedGroup,
    OwnedRow,
    ShardedAttentionMetadata,
    grouped_owned_attention,
    long_owned_attention,
    owned_attention,
    sharded_partials,
)


@register_backend
class PagedMLABackend(AttentionBackend):
    name = "PAGED_MLA"
    kinds = ("mla_attention",)

    @classmethod
    def supports_pcp(cls) -> bool:
        return True  # every row's prefix is read back from the cache after the write

    @classmethod
    def supports_kv_sharding(cls) -> bool:
        return True

    @classmethod
    def splits_prompt_keys(cls) -> bool:
        # a prompt chunk expands every latent it reads: replicated PCP ranks each expanded the whole context, every
        # step (DeepSeek-V3 shapes at 16k, PCP = 2, avx2 EPYC: efficiency 0.47-0.49, 0.91-0.98 with the keys split)
        return True

    @classmethod
    def prepare_metadata(cls, batch: AttentionBatch) -> AttentionMetadata | ShardedAttentionMetadata:
        return paged_metadata(cls, batch)  # the CPU plan (metadata.py), or the owned keys under sharded KV

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, kv_lora_rank + rope_dim)

    @staticmethod
    def forward_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, up: MLAUpProjection) -> torch.Tensor:
        # q_nope: [T, H, nope]; q_pe: [T, H, rope]; entries: [T, L + rope] this step's latents -> [T, H, v]
        cache_flat = kv_cache.flatten(0, 1)  # [num_slots, L + R]
        write_kv(cache_flat, entries, meta)
        expanded_prefix.note_writes(up, meta.write_slots)
        lora = up.w_uk.shape[-1]
        lat = cache_flat.unsqueeze(1)  # [num_slots, 1, L + R]
        # the short rows' shared prefix (cascade), attended in its expanded form when that is kept for this layer
        kept = None if meta.shared_prefix is None else expanded_prefix.lookup(cache_flat, meta.shared_prefix, up,
                                                                              q_nope.dtype)
        if not meta.long_rows:  # decodes and verification rows only: every token absorbed
            q_abs = absorb(q_nope, q_pe, up)
            if kept is None:
                return up_project(prefix_attention(q_abs, lat, None, meta, scale, value_dims=lora), up)
            o_latent, lse = own_key_attention(q_abs, lat, None, meta, scale, lora)
            assert meta.shared_prefix is not None and lse is not None
            return expanded_prefix.merge_expanded_prefix(q_nope, q_pe, up_project(o_latent, up), lse,
                                                         meta.shared_prefix, kept, scale)
        out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], up.w_uv.shape[1])
        # short rows beside prompt chunks: absorb only the short rows' tokens
        if meta.groups or meta.row_keys or meta.native_rows is not None:
            short = torch.ones(q_nope.shape[0], dtype=torch.bool, device=q_nope.device)
            for piece in (p for lr in meta.long_rows for p in lr.pieces):
                short[piece.token_start: piece.token_start + piece.num_queries] = False
            q_abs = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], lora + q_pe.shape[-1])
            q_abs[short] = absorb(q_nope[short], q_pe[short], up)
            if kept is None:
                o_latent = prefix_attention(q_abs, lat, None, meta, scale, value_dims=lora, long_rows=False)
                out[short] = up_project(o_latent[short], up)
            else:
                o_latent, lse = own_key_attention(q_abs, lat, None, meta, scale, lora, long_rows=False)
                assert meta.shared_prefix is not None and lse is not None
                out[short] = up_project(o_latent[short], up)
                out = expanded_prefix.merge_expanded_prefix(q_nope, q_pe, out, lse, meta.shared_prefix, kept, scale)
        shared, num_shared = None, 0
        num_sharing = sum(lr.shares_prefix for lr in meta.long_rows)
        # a prompt chunk behind the prefix the short rows keep expanded (a new request's prefix-cache hit on a shared
        # few-shot or system prompt) reuses that expansion: only its own keys are gathered and expanded
        held = kept if kept is not None else expanded_prefix.peek(up, q_nope.dtype)
        for lr in meta.long_rows:
            reused = 0 if held is None else held.reusable_by(lr.kv_slots)
            if reused and prefers_expanded(lr.num_queries, lr.seq_len, up, q_pe.shape[-1], reused, 1 << 30):
                assert held is not None
                latent = gather_rows(cache_flat, lr.kv_slots[reused:]).to(q_nope.dtype)  # [S - P, L + R]
                long_row_attention(q_nope, q_pe, latent, lr.pieces, scale, up, True, out, held.as_shared())
                continue
            prefix = meta.long_prefix if lr.shares_prefix else None
            expanded = prefers_expanded(lr.num_queries, lr.seq_len, up, q_pe.shape[-1],
                                        0 if prefix is None else prefix.num_keys, num_sharing)
            if expanded and prefix is not None:  # expanded once a layer, not a row
                if shared is None:
                    lat = prefix.keys(cache_flat).to(q_nope.dtype)  # [P, L + R]
                    shared, num_shared = expand_latents(lat, up), prefix.num_keys
                latent = gather_rows(cache_flat, lr.kv_slots[num_shared:]).to(q_nope.dtype)  # [S - P, L + R]
                long_row_attention(q_nope, q_pe, latent, lr.pieces, scale, up, True, out, shared)
                continue
            latent = gather_rows(cache_flat, lr.kv_slots).to(q_nope.dtype)  # [S, L + R], read once per layer
            long_row_attention(q_nope, q_pe, latent, lr.pieces, scale, up, expanded, out)
        return out

    @staticmethod
    def forward_mla_sharded(q: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                            meta: ShardedAttentionMetadata, scale: float,
                            up: MLAUpProjection) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T_global, H, nope + rope] every query of the step; entries: [num gathered, L + rope] new latents
        cache_flat = kv_cache.flatten(0, 1)  # [num_local_slots, L + R]
        write_kv(cache_flat, entries, meta)
        expanded_prefix.note_writes(up, meta.write_slots)
        heads, nope, lora = up.w_uk.shape
        rope = q.shape[-1] - nope
        lat = cache_flat.unsqueeze(1)  # [num_local_slots, 1, L + R]: MQA, the values are the keys' first L

        def row_attention(row: OwnedRow, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            num_keys = row.num_shared + row.diag_slots.shape[0]
            if row.num_queries > SHORT_ROW_TOKENS and prefers_expanded(row.num_queries, num_keys, up, rope):
                latent = torch.cat((select_rows(cache_flat, row.shared_slots()),
                                    select_rows(cache_flat, row.diag_slots))).to(q.dtype)  # [S, L + R]
                kv = torch.matmul(latent[:, :lora], up.kv_b().t()).view(-1, heads, nope + up.w_uv.shape[1])
                k = torch.cat((kv[..., :nope], latent[:, None, lora:].expand(-1, heads, -1)), dim=-1)  # [S, H, D]
                return long_owned_attention(qr, k, kv[..., nope:], row.num_shared, row, scale)
            o_latent, lse = owned_attention(absorb(qr[..., :nope], qr[..., nope:], up), lat, None, row, scale, lora)
            return up_project(o_latent, up), lse

        def group_attention(group: OwnedGroup) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = group.token_idx.flatten()
            q_abs = absorb(q[tokens, :, :nope], q[tokens, :, nope:], up)  # [G Q, H, L + R], the group's queries only
            g, num_q = group.token_idx.shape
            own = OwnedGroup(torch.arange(g * num_q, device=q.device).view(g, num_q), group.token_valid,
                             group.kv_slots, group.visible)
            o_latent, lse = grouped_owned_attention(q_abs, lat, None, own, scale, lora)  # [G, Q, H, L]
            return up_project(o_latent.flatten(0, 1), up).view(g, num_q, heads, -1), lse

        return sharded_partials(meta, q, row_attention, up.w_uv.shape[1], group_attention)
