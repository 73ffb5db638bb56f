"""One flash-style Triton kernel for paged attention: decode rows, verification rows and prompt chunks alike.

Every query row (a request's new tokens in this step, or a PCP segment of them) is cut into tiles of BLOCK_Q tokens;
a program takes one tile and BLOCK_H of the query heads that share one KV head, so its BLOCK_M = BLOCK_Q * BLOCK_H
query vectors read each key tile once (GQA's K/V reuse; MLA's latent is one KV head for every query head). It walks
the row's keys in tiles of BLOCK_N positions, reading K/V in place through the block table (a key's slot is
`block_table[row, pos // block_size] * block_size + pos % block_size`, so any cache block size works), with an
online softmax in float32, and writes the output and the log-sum-exp that PCP's split-KV merge needs. Causality
comes from positions (a query at position p sees keys 0..p, and at most the row's seq_len), never from offsets, as
every tandem backend decides it.

The key is split in two parts so MLA's 576-wide latent key needs no padding to 1024: scores are
`q[:, :D1] . k[:, :D1] + q[:, D1:D1+D2] . k[:, D1:D1+D2]` (D2 = 0 for GQA; MLA: D1 = kv_lora_rank 512, D2 = rope 64,
and the values are the key's first DV = 512 channels, read from the same cache).

Owner-sharded KV (`pcp_kv_layout: sharded`): global block b lives on rank b % P as local block b // P
(tandem/attention/kv_ownership.py); with PCP_SIZE > 1 the kernel reads only the keys of the blocks this rank owns, and
a query that owns none gets output 0 and log-sum-exp -inf.

The same Python function is compiled by Triton for CUDA tensors and run by Triton's interpreter for CPU tensors
(tests run it there). The interpreter only runs Triton's builtins, so the kernel reduces with `tl.reduce` and the
standard combine functions instead of `tl.sum` / `tl.max`, and `tl.full` for `tl.zeros` (jit-decorated helpers that
only a compiled kernel can call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from tandem.attention.batch import AttentionBatch
from tandem.attention.kv_ownership import owned_writes
from tandem.attention.sharded_kv import merge_partials

BLOCK_N = 32  # keys a program attends per iteration
MIN_BLOCK_M = 16  # tl.dot's smallest M on NVIDIA GPUs
MAX_BLOCK_M = 64  # query vectors per program (prompt chunks)
MAX_BLOCK_H = 16  # query heads per program (MLA's 16-128 heads are split over programs)
# split-KV: below TARGET_PROGRAMS programs (an H200 has 132 SMs), a long context's keys are split over programs, each
# split at least MIN_SPLIT_KEYS keys, at most MAX_SPLITS splits
TARGET_PROGRAMS = 256
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 16


def _paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,  # q [T, Hq, D1 + D2]; k/v caches [num_slots, Hkv, ...]; out [T, Hq, DV]
    tile_row_ptr, tile_start_ptr,  # [num_tiles] the row of each tile and its first query token
    query_start_ptr, seq_lens_ptr, positions_ptr, block_table_ptr,  # the step's batch
    scale, keys_per_split,  # split-KV: program (.., .., s) attends keys [s * keys_per_split, (s + 1) * keys_per_split)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_os, stride_ot, stride_oh, stride_ls,
    stride_lt, stride_bt,
    NUM_Q_PER_KV: tl.constexpr, HEAD_TILES: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D1: tl.constexpr, BLOCK_D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    PCP_RANK: tl.constexpr, PCP_SIZE: tl.constexpr, WITH_LSE: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr, P_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    head_tile = tl.program_id(1) % HEAD_TILES
    split = tl.program_id(2)
    row = tl.load(tile_row_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    q_end = tl.load(query_start_ptr + row + 1)
    seq_len = tl.load(seq_lens_ptr + row)

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    token = first + offs_m // BLOCK_H  # [M] query tokens
    in_group = head_tile * BLOCK_H + offs_m % BLOCK_H
    head = kv_head * NUM_Q_PER_KV + in_group  # [M] query heads
    valid = (token < q_end) & (in_group < NUM_Q_PER_KV)
    pos = tl.load(positions_ptr + token, mask=valid, other=-1)  # [M]

    offs_d1 = tl.arange(0, BLOCK_D1)
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q1 = tl.load(q_rows + offs_d1[None, :], mask=valid[:, None] & (offs_d1[None, :] < D1), other=0.0).to(COMPUTE)
    if D2 > 0:
        offs_d2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + D1 + offs_d2[None, :], mask=valid[:, None] & (offs_d2[None, :] < D2),
                     other=0.0).to(COMPUTE)
    offs_dv = tl.arange(0, BLOCK_DV)

    # keys past the tile's last query position, or past the row's seq_len, are seen by no query of the tile
    key_limit = tl.minimum(tl.reduce(pos, 0, tl.standard._elementwise_max) + 1, seq_len)
    key_start = split * keys_per_split
    key_limit = tl.minimum(key_limit, key_start + keys_per_split)
    m_i = tl.full((BLOCK_Q * BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_Q * BLOCK_H,), 0.0, tl.float32)
    acc = tl.full((BLOCK_Q * BLOCK_H, BLOCK_DV), 0.0, tl.float32)
    for start in range(key_start, key_limit, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)  # [N] key positions
        in_range = kpos < key_limit
        block = tl.load(block_table_ptr + row * stride_bt + kpos // CACHE_BLOCK, mask=in_range, other=0)
        if PCP_SIZE > 1:
            in_range = in_range & (block % PCP_SIZE == PCP_RANK)
            block = block // PCP_SIZE
        slot = block.to(tl.int64) * CACHE_BLOCK + kpos % CACHE_BLOCK  # [N]
        k_rows = k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh
        k1 = tl.load(k_rows + offs_d1[None, :], mask=in_range[:, None] & (offs_d1[None, :] < D1), other=0.0)
        s = tl.dot(q1, tl.trans(k1.to(COMPUTE)), input_precision=PRECISION)  # [M, N]
        if D2 > 0:
            k2 = tl.load(k_rows + D1 + offs_d2[None, :], mask=in_range[:, None] & (offs_d2[None, :] < D2), other=0.0)
            s += tl.dot(q2, tl.trans(k2.to(COMPUTE)), input_precision=PRECISION)
        seen = in_range[None, :] & (kpos[None, :] <= pos[:, None])
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that has seen no key yet keeps p = 0
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                    mask=in_range[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE).to(COMPUTE), v.to(COMPUTE), input_precision=PRECISION)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        m_i = m_new

    seen_any = l_i > 0.0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    tl.store(out_ptr + split * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_dv[None, :] < DV))
    if WITH_LSE:
        lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + token * stride_lt + head, lse, mask=valid)


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_COMPILED = triton.jit(_paged_attention)
_INTERPRETED = InterpretedFunction(_paged_attention)


@dataclass(frozen=True)
class TritonMetadata:
    """The kernel's view of a batch: the batch's tensors on its device, and its query tiles per tile height (built
    on first use: GQA and MLA layers of one batch may tile differently)."""

    query_start_loc_cpu: torch.Tensor  # [num_rows + 1] int32
    longest_row: int  # queries of the batch's longest row (tiles are sized for it)
    longest_keys: int  # keys the batch's longest row sees (key splits are sized for it)
    query_start_loc: torch.Tensor  # [num_rows + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_rows] int32
    positions: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_rows, max_num_blocks] int32 (global block ids under sharded KV)
    block_size: int
    write_rows: torch.Tensor  # [num_writes] int64 rows of the (gathered) new K/V this rank writes
    write_slots: torch.Tensor  # [num_writes] int64 their slots in this rank's cache
    pcp_rank: int = 0
    pcp_size: int = 1  # > 1: owner-sharded KV, the keys of blocks b with b % pcp_size == pcp_rank
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    def tiles_for(self, num_q_per_kv: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(block_q, tile_row [num_tiles] int32, tile_start [num_tiles] int32): tiles sized for the longest row,
        decode rows the smallest tile tl.dot allows, prompt chunks up to MAX_BLOCK_M query vectors."""
        bh = block_h(num_q_per_kv)
        block_q = max(min(triton.next_power_of_2(max(self.longest_row, 1)), max(MAX_BLOCK_M // bh, 1)),
                      max(MIN_BLOCK_M // bh, 1))
        if block_q not in self.tiles:
            tile_row, tile_start = plan_tiles(self.query_start_loc_cpu.numpy(), block_q)
            device = self.positions.device
            self.tiles[block_q] = (torch.from_numpy(tile_row).to(device), torch.from_numpy(tile_start).to(device))
        return block_q, *self.tiles[block_q]


def block_h(num_q_per_kv: int) -> int:
    return min(triton.next_power_of_2(num_q_per_kv), MAX_BLOCK_H)


def plan_tiles(query_start_loc: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """[num_rows + 1] query offsets -> (tile_row, tile_start): each row's queries in tiles of block_q tokens."""
    counts = np.diff(query_start_loc)
    tiles = -(-counts // block_q)  # [num_rows], 0 for an empty row
    tile_row = np.repeat(np.arange(counts.shape[0]), tiles)
    within = np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    return tile_row.astype(np.int32), (query_start_loc[tile_row] + within * block_q).astype(np.int32)


def triton_metadata(batch: AttentionBatch) -> TritonMetadata:
    device = batch.positions.device
    write_rows, write_slots, rank, size = batch.write_rows, batch.write_slots, 0, 1
    if batch.kv_shard is not None:  # this rank writes (and reads) only the blocks it owns, at their local slots
        rank, size = batch.kv_shard.rank, batch.kv_shard.size
        keep, local = owned_writes(batch.write_slots.cpu().numpy(), batch.block_size, rank, size)
        write_rows = batch.write_rows[torch.from_numpy(keep).to(batch.write_rows.device)]
        write_slots = torch.from_numpy(local.astype(np.int64)).to(device)
    return TritonMetadata(
        query_start_loc_cpu=batch.query_start_loc_cpu,
        longest_row=int(batch.query_start_loc_cpu.diff().max()) if batch.query_start_loc_cpu.numel() > 1 else 1,
        longest_keys=int(batch.seq_lens_cpu.max()) if batch.seq_lens_cpu.numel() else 0,
        query_start_loc=batch.query_start_loc_cpu.to(device=device, dtype=torch.int32),
        seq_lens=batch.seq_lens_cpu.to(device=device, dtype=torch.int32), positions=batch.positions,
        block_table=batch.block_table.to(torch.int32), block_size=batch.block_size, write_rows=write_rows,
        write_slots=write_slots, pcp_rank=rank, pcp_size=size)


def num_key_splits(programs: int, longest_keys: int, on_gpu: bool) -> int:
    """Split-KV (flash-decoding) for a grid too small to fill a GPU: a batch-1 decode is one program per KV head,
    which reads a long context at one SM's bandwidth. Each split attends a key range of its own; their partials
    merge by log-sum-exp. Never on the CPU (the interpreter gains nothing from more programs)."""
    if not on_gpu or programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(-(-longest_keys // MIN_SPLIT_KEYS), -(-TARGET_PROGRAMS // programs), MAX_SPLITS))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata,
                    scale: float, value_dim: int, rope_dim: int = 0, with_lse: bool = False,
                    num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D1 + rope_dim]; k_cache [num_slots, Hkv, >= D1 + rope_dim]; v_cache [num_slots, Hkv, >= value_dim]
    (views of the paged cache: MLA passes its latent cache as both, with one KV head) -> (out [T, Hq, value_dim],
    lse [T, Hq] float32 or None). With the log-sum-exp the output is float32 (a partial for the merge), else q's
    dtype. Tokens in no row (graph padding) get zeros. `num_splits`: key splits (None: num_key_splits')."""
    num_tokens, num_heads, width = q.shape
    num_kv_heads = k_cache.shape[1]
    num_q_per_kv = num_heads // num_kv_heads
    d1 = width - rope_dim
    block_q, tile_row, tile_start = meta.tiles_for(num_q_per_kv)
    num_tiles = tile_row.shape[0]
    bh = block_h(num_q_per_kv)
    head_tiles = -(-num_q_per_kv // bh)
    longest_keys = meta.longest_keys
    splits = num_splits or num_key_splits(num_tiles * num_kv_heads * head_tiles, longest_keys, q.is_cuda)
    keys_per_split = -(-max(longest_keys, 1) // (splits * BLOCK_N)) * BLOCK_N
    splits = -(-max(longest_keys, 1) // keys_per_split)  # no split left without keys
    partial = with_lse or splits > 1
    out = torch.zeros(splits, num_tokens, num_heads, value_dim, dtype=torch.float32 if partial else q.dtype,
                      device=q.device)
    lse = torch.full((splits, num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device) \
        if partial else out.new_empty(1, 1, 1, dtype=torch.float32)
    if num_tiles:
        kernel = _COMPILED if q.is_cuda else _INTERPRETED
        q = q.contiguous() if q.stride(-1) != 1 else q
        kernel[(num_tiles, num_kv_heads * head_tiles, splits)](
            q, k_cache, v_cache, out, lse,
            tile_row, tile_start, meta.query_start_loc, meta.seq_lens, meta.positions, meta.block_table,
            scale, keys_per_split,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), meta.block_table.stride(0),
            NUM_Q_PER_KV=num_q_per_kv, HEAD_TILES=head_tiles, CACHE_BLOCK=meta.block_size,
            BLOCK_Q=block_q, BLOCK_H=bh, BLOCK_N=BLOCK_N,
            D1=d1, BLOCK_D1=max(triton.next_power_of_2(d1), 16),
            D2=rope_dim, BLOCK_D2=max(triton.next_power_of_2(rope_dim), 16) if rope_dim else 16,
            DV=value_dim, BLOCK_DV=max(triton.next_power_of_2(value_dim), 16),
            PCP_RANK=meta.pcp_rank, PCP_SIZE=meta.pcp_size, WITH_LSE=partial,
            # float32 keeps IEEE products (tf32 would break float32 parity with Hugging Face); 16-bit dots are exact
            # in float32 accumulation anyway
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            # the dots take q's dtype on a GPU (float32 accumulation); the interpreter's dots on 16-bit values are
            # not right, so there they run in float32 on the same operands, the probabilities rounded to q's dtype
            COMPUTE=_TL_DTYPE[q.dtype] if q.is_cuda else tl.float32, P_DTYPE=_TL_DTYPE[q.dtype],
        )
    if splits == 1:
        return out[0], lse[0] if with_lse else None
    merged = merge_partials(out, lse)  # [T, Hq, DV] float32
    if with_lse:
        return merged, torch.logsumexp(lse, dim=0)
    return merged.to(q.dtype), None
