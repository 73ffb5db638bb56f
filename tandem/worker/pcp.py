"""Prefill context parallelism as index math: split the GLOBAL batch into rank-local query segments
(DualChunkSwap), and map the all-gathered local outputs back to global order. No collectives here.

A prefill row of L tokens is cut into 2P chunks of ceil(L/2P); rank r owns chunks r and 2P-1-r, each
owned non-empty chunk a local row of its own. Decode rows are replicated on every rank. Every rank
pads its local tokens to `max_local_tokens`, so the all-gather places rank r's local token j at
gathered index r * max_local_tokens + j.

Worked example, P = 2, global batch [A B | c0 .. c7] + 2 graph-padding tokens: A (position 9) and
B (position 4) are one-token decode rows, c0..c7 a prompt chunk at positions 0..7 split into
[c0 c1] [c2 c3] [c4 c5] [c6 c7]:
    query_start_loc = [0, 1, 2, 10], is_prefill = [F, F, T], num_padding = 2

    rank0: [A B | c0 c1 c6 c7]                       rank1: [A B | c2 c3 c4 c5]
      local_token_idx         [0, 1, 2, 3, 8, 9]       [0, 1, 4, 5, 6, 7]
      local_query_start_loc   [0, 1, 2, 4, 6]          [0, 1, 2, 4, 6]
      local_row_to_global_row [0, 1, 2, 2]             [0, 1, 2, 2]
      positions               [9, 4, 0, 1, 6, 7]       [9, 4, 2, 3, 4, 5]
      seq_lens                [10, 5, 2, 8]            [10, 5, 4, 6]
      num_computed            [9, 4, 0, 6]             [9, 4, 2, 4]

    max_local_tokens = 6; gathered = [rank0's 6 | rank1's 6] =
      [A B c0 c1 c6 c7 | A B c2 c3 c4 c5]   (indices 0..5 | 6..11)
    restore_idx  = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, -1, -1]   (A, B from rank 0; padding -> zero row)
    kv_write_idx = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5]           (= restore_idx without the padding)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.attention.kv_dtype import FP8_DTYPES


@dataclass(frozen=True)
class PCPPartition:
    pcp_size: int
    num_tokens: int  # T_global: tokens that belong to a row (graph padding excluded)
    max_local_tokens: int  # max over ranks of T_r; every rank pads to it before the all-gather
    local_token_idx: tuple[np.ndarray, ...]  # per rank: [T_r] int64 global token index of each local token
    local_query_start_loc: tuple[np.ndarray, ...]  # per rank: [R_r + 1] int32
    local_row_to_global_row: tuple[np.ndarray, ...]  # per rank: [R_r] int64 global row of each local segment
    restore_idx: np.ndarray  # [T_global + num_padding] int64 index into the gathered space; padding -> -1

    @property
    def num_padding(self) -> int:
        return self.restore_idx.shape[0] - self.num_tokens

    @property
    def kv_write_idx(self) -> np.ndarray:  # [T_global] int64 gathered index whose K/V is written
        # The copy that is restored is exactly the copy whose K/V is written (prefill tokens from their
        # owner, decode tokens from rank 0), so each global token is written once from one mapping.
        return self.restore_idx[: self.num_tokens]


@dataclass(frozen=True)
class LocalView:
    token_idx: np.ndarray  # [T_r] int64 global token index; gathers input_ids and friends
    positions: np.ndarray  # [T_r] taken from the global positions
    query_start_loc: np.ndarray  # [R_r + 1] int32
    seq_lens: np.ndarray  # [R_r] int32, segment end position + 1
    num_computed: np.ndarray  # [R_r] int32, segment start position
    block_table: np.ndarray  # [R_r, max_blocks] the global row's block table


def partition(query_start_loc: np.ndarray, is_prefill: np.ndarray, pcp_size: int,
              num_padding: int = 0) -> PCPPartition:
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    prefill = np.asarray(is_prefill, dtype=bool)
    _validate(qsl, prefill, pcp_size, num_padding)
    segments = _rank_segments(qsl, prefill, pcp_size)
    local_qsl, local_rows, local_idx = [], [], []
    for segs in segments:
        rows, starts, ends = np.array(segs, dtype=np.int64).reshape(-1, 3).T
        lens = ends - starts
        qsl_r = np.zeros(len(segs) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl_r[1:])
        local_qsl.append(qsl_r)
        local_rows.append(rows)
        # Token j of segment s sits at global index starts[s] + (j - qsl_r[s]).
        local_idx.append(np.repeat(starts - qsl_r[:-1], lens) + np.arange(qsl_r[-1], dtype=np.int64))
    max_local = max(len(idx) for idx in local_idx)
    num_tokens = int(qsl[-1])
    restore_idx = np.full(num_tokens + num_padding, -1, dtype=np.int64)
    # Rank 0 is written last so replicated decode tokens resolve to its copy; prefill tokens have one owner.
    for rank in reversed(range(pcp_size)):
        restore_idx[local_idx[rank]] = rank * max_local + np.arange(len(local_idx[rank]))
    return PCPPartition(pcp_size=pcp_size, num_tokens=num_tokens, max_local_tokens=max_local,
                        local_token_idx=tuple(local_idx), local_query_start_loc=tuple(local_qsl),
                        local_row_to_global_row=tuple(local_rows), restore_idx=restore_idx)


def _validate(qsl: np.ndarray, prefill: np.ndarray, pcp_size: int, num_padding: int) -> None:
    if pcp_size < 1:
        raise ValueError(f"pcp_size={pcp_size}: must be >= 1")
    if num_padding < 0:
        raise ValueError(f"num_padding={num_padding}: must be >= 0")
    if qsl.ndim != 1 or len(qsl) < 2 or qsl[0] != 0 or np.any(np.diff(qsl) < 1):
        raise ValueError(f"query_start_loc={qsl.tolist()}: must start at 0 and describe >= 1 non-empty rows")
    if prefill.shape != (len(qsl) - 1,):
        raise ValueError(f"is_prefill has shape {prefill.shape}: must be ({len(qsl) - 1},), one flag per row")


def _rank_segments(qsl: np.ndarray, prefill: np.ndarray, pcp_size: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, its (global row, global start, global end) segments in local order."""
    # With one rank a row stays whole, so P = 1 is the identity (the single-rank oracle's own layout).
    num_chunks = 2 * pcp_size if pcp_size > 1 else 1
    segments: list[list[tuple[int, int, int]]] = [[] for _ in range(pcp_size)]
    for row, (start, end) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True)):
        if not prefill[row]:
            for segs in segments:
                segs.append((row, start, end))
            continue
        size = -(-(end - start) // num_chunks)
        for rank, segs in enumerate(segments):
            for chunk in sorted({rank, num_chunks - 1 - rank}):
                lo, hi = min(start + chunk * size, end), min(start + (chunk + 1) * size, end)
                if hi > lo:
                    segs.append((row, lo, hi))
    return segments


def local_metadata(part: PCPPartition, rank: int, positions: np.ndarray, block_table: np.ndarray) -> LocalView:
    """Rank-local attention inputs; `positions` [T_global(+padding)] and `block_table` [R, max_blocks] are global."""
    token_idx = part.local_token_idx[rank]
    qsl = part.local_query_start_loc[rank]
    local_positions = np.asarray(positions)[token_idx]
    # Positions come from the global batch (a mid-prompt chunk or a rolled-back decode starts anywhere),
    # so the segment's bounds are read off its first and last token rather than re-derived.
    return LocalView(
        token_idx=token_idx, positions=local_positions, query_start_loc=qsl,
        seq_lens=(local_positions[qsl[1:] - 1] + 1).astype(np.int32),
        num_computed=local_positions[qsl[:-1]].astype(np.int32),
        block_table=np.asarray(block_table)[part.local_row_to_global_row[rank]])


def pad_local(x_local: torch.Tensor, part: PCPPartition) -> torch.Tensor:
    """[T_r, ...] -> [max_local_tokens, ...], zero rows appended: equal sizes for the all-gather."""
    num_pad = part.max_local_tokens - x_local.shape[0]
    if num_pad < 0:
        raise ValueError(f"x_local has {x_local.shape[0]} rows: more than max_local_tokens={part.max_local_tokens}")
    return torch.cat([x_local, x_local.new_zeros((num_pad, *x_local.shape[1:]))])


def restore(gathered: torch.Tensor, part: PCPPartition) -> torch.Tensor:
    """[P * max_local_tokens, ...] all-gathered rows -> [T_global + num_padding, ...], zero rows for padding."""
    expected = part.pcp_size * part.max_local_tokens
    if gathered.shape[0] != expected:
        raise ValueError(f"gathered has {gathered.shape[0]} rows: expected pcp_size * max_local_tokens = {expected}")
    idx = torch.from_numpy(part.restore_idx).to(gathered.device)
    out = gathered[idx.clamp(min=0)]
    if part.num_padding:
        # float8 (a drafter's stored context K/V) has no masked_fill on the CPU: its zero is the zero byte
        raw = out.view(torch.uint8) if out.dtype in FP8_DTYPES else out
        out = raw.masked_fill((idx < 0).view(-1, *([1] * (out.dim() - 1))), 0).view(out.dtype)
    return out


@dataclass(frozen=True)
class RowGather:
    """How to gather only some global rows (the rows whose logits are computed, or the drafter's last
    tokens) instead of restoring all of them: each rank sends just the requested rows it holds."""

    local_rows: tuple[np.ndarray, ...]  # per rank: [m_r] int64 local index of each requested row it sends
    max_rows: int  # max over ranks of m_r; every rank pads to it before the all-gather
    out_idx: np.ndarray  # [len(rows)] int64 index into the gathered [P * max_rows] space; padding row -> -1


def row_gather(part: PCPPartition, rows: np.ndarray) -> RowGather:
    """Requested global rows -> who sends which local row. Each row comes from the copy restore() would take
    (a prefill token's owner, a decode token's rank-0 copy), so restore_rows(...) == restore(...)[rows]."""
    src = part.restore_idx[np.asarray(rows, dtype=np.int64)]  # [n] index into the full gathered space
    owner = np.where(src >= 0, src // max(part.max_local_tokens, 1), -1)
    picks = [np.flatnonzero(owner == r) for r in range(part.pcp_size)]  # positions in `rows` rank r sends
    max_rows = max(len(p) for p in picks)
    out_idx = np.full(len(src), -1, dtype=np.int64)
    for r, pick in enumerate(picks):
        out_idx[pick] = r * max_rows + np.arange(len(pick))
    local_rows = tuple(src[pick] - r * part.max_local_tokens for r, pick in enumerate(picks))
    return RowGather(local_rows, max_rows, out_idx)


def select_rows(x_local: torch.Tensor, plan: RowGather, rank: int) -> torch.Tensor:
    """[T_r, ...] -> [max_rows, ...] this rank's share of the requested rows, zero-padded."""
    idx = torch.from_numpy(plan.local_rows[rank]).to(x_local.device)
    rows = x_local[idx]
    num_pad = plan.max_rows - rows.shape[0]
    return torch.cat([rows, rows.new_zeros((num_pad, *rows.shape[1:]))]) if num_pad else rows


def restore_rows(gathered: torch.Tensor, plan: RowGather) -> torch.Tensor:
    """[P * max_rows, ...] all-gathered shares -> [len(rows), ...] in request order, zero rows for padding."""
    if plan.max_rows == 0:  # nothing but padding rows was asked for
        return gathered.new_zeros((len(plan.out_idx), *gathered.shape[1:]))
    idx = torch.from_numpy(plan.out_idx).to(gathered.device)
    out = gathered[idx.clamp(min=0)]
    if (plan.out_idx < 0).any():
        out = out.masked_fill((idx < 0).view(-1, *([1] * (out.dim() - 1))), 0)
    return out
