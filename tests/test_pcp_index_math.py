"""Property tests of tandem/worker/pcp.py's index math against a fake all-gather, on random mixed batches.
Scope: partition / local_metadata / pad_local / restore / kv_write_idx, the DESIGN example and P = 1 identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.worker.pcp import (
    PCPPartition,
    local_metadata,
    pad_local,
    partition,
    restore,
    restore_rows,
    row_gather,
    select_rows,
)

PCP_SIZES = [1, 2, 3, 4, 8]


@dataclass
class Batch:
    query_start_loc: np.ndarray  # [R + 1] int32
    is_prefill: np.ndarray  # [R] bool
    positions: np.ndarray  # [T + num_padding] int64, padding positions are 0
    block_table: np.ndarray  # [R, 4] int32, row-distinct values
    pcp_size: int
    num_padding: int

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    # Short lengths are drawn often so prefill rows shorter than 2P (with empty chunks) are common.
    length = st.one_of(st.integers(1, 16), st.integers(1, 200))
    rows = draw(st.lists(st.tuples(length, st.booleans(), st.integers(0, 1000)), min_size=1, max_size=12))
    lens = np.array([n for n, _, _ in rows], dtype=np.int64)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    num_padding = draw(st.integers(0, 7))
    # Each row starts at its own offset, like a chunked prefill resuming mid-prompt or a decode deep in a sequence.
    positions = np.concatenate([np.arange(s, s + n) for n, _, s in rows] + [np.zeros(num_padding, np.int64)])
    block_table = (np.arange(len(rows) * 4, dtype=np.int32).reshape(-1, 4) + 100)
    return Batch(qsl, np.array([p for _, p, _ in rows], dtype=bool), positions, block_table,
                 draw(st.sampled_from(PCP_SIZES)), num_padding)


def _partition(b: Batch) -> PCPPartition:
    return partition(b.query_start_loc, b.is_prefill, b.pcp_size, b.num_padding)


def _fake_all_gather(x: torch.Tensor, part: PCPPartition) -> torch.Tensor:
    """Every rank localizes the same global x, pads, and the all-gather concatenates ranks in order."""
    return torch.cat([pad_local(x[torch.from_numpy(idx)], part) for idx in part.local_token_idx])


def _row_spans(b: Batch) -> list[tuple[int, int, bool]]:
    qsl = b.query_start_loc.tolist()
    return [(qsl[i], qsl[i + 1], bool(b.is_prefill[i])) for i in range(len(qsl) - 1)]


def _reference_owner(offset: int, length: int, pcp_size: int) -> int:
    """Plain DualChunkSwap: which rank owns token `offset` of a prefill row of `length` tokens."""
    if pcp_size == 1:
        return 0
    chunk = offset // -(-length // (2 * pcp_size))
    return chunk if chunk < pcp_size else 2 * pcp_size - 1 - chunk


@settings(max_examples=150, deadline=None)
@given(batches())
def test_restore_of_gathered_local_tensors_is_global_with_zero_padding(b: Batch) -> None:
    part = _partition(b)
    x = torch.randn(b.num_tokens + b.num_padding, 3)
    x[b.num_tokens:] = 0
    restored = restore(_fake_all_gather(x[: b.num_tokens], part), part)
    assert restored.shape == x.shape, f"restored {tuple(restored.shape)} != global {tuple(x.shape)}"
    torch.testing.assert_close(restored, x, rtol=0, atol=0)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_prefill_tokens_have_one_owner_and_decode_tokens_are_on_every_rank(b: Batch) -> None:
    part = _partition(b)
    counts = np.zeros(b.num_tokens, dtype=np.int64)
    for rank, idx in enumerate(part.local_token_idx):
        assert np.all(np.diff(idx) > 0), f"rank {rank}: local tokens not in global order: {idx.tolist()}"
        counts[idx] += 1
    for start, end, is_prefill in _row_spans(b):
        want = 1 if is_prefill else b.pcp_size
        assert np.all(counts[start:end] == want), f"row [{start}, {end}) prefill={is_prefill}: {counts[start:end]}"
        if not is_prefill:
            continue
        owners = {int(t) - start: r for r, idx in enumerate(part.local_token_idx) for t in idx if start <= t < end}
        ref = {o: _reference_owner(o, end - start, b.pcp_size) for o in range(end - start)}
        assert owners == ref, f"row [{start}, {end}): owners differ from DualChunkSwap reference"


@settings(max_examples=150, deadline=None)
@given(batches())
def test_prefill_work_is_balanced_within_one_chunk_per_row(b: Batch) -> None:
    part = _partition(b)
    totals = np.zeros(b.pcp_size, dtype=np.int64)
    slack = 0
    for start, end, is_prefill in _row_spans(b):
        if not is_prefill:
            continue
        chunk = -(-(end - start) // (2 * b.pcp_size))
        per_rank = np.array([np.count_nonzero((idx >= start) & (idx < end)) for idx in part.local_token_idx])
        assert per_rank.max() - per_rank.min() <= chunk, f"row [{start}, {end}): per-rank counts {per_rank}"
        totals += per_rank
        slack += chunk
    assert totals.max() - totals.min() <= slack, f"per-rank prefill totals {totals}, allowed spread {slack}"


@settings(max_examples=150, deadline=None)
@given(batches())
def test_local_metadata_agrees_with_global_positions(b: Batch) -> None:
    part = _partition(b)
    row_of_token = np.repeat(np.arange(len(b.is_prefill)), np.diff(b.query_start_loc))
    for rank in range(b.pcp_size):
        view = local_metadata(part, rank, b.positions, b.block_table)
        rows = part.local_row_to_global_row[rank]
        qsl = view.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == len(view.positions), f"rank {rank}: qsl {qsl.tolist()}"
        np.testing.assert_array_equal(view.positions, b.positions[part.local_token_idx[rank]])
        for s, row in enumerate(rows.tolist()):
            seg_pos = view.positions[qsl[s]:qsl[s + 1]]
            seg_rows = row_of_token[part.local_token_idx[rank][qsl[s]:qsl[s + 1]]]
            assert len(seg_pos) > 0 and np.all(seg_rows == row), f"rank {rank} segment {s} not inside row {row}"
            assert np.all(np.diff(seg_pos) == 1), f"rank {rank} segment {s}: non-contiguous positions {seg_pos}"
            assert view.seq_lens[s] == seg_pos[-1] + 1, f"rank {rank} segment {s}: seq_len {view.seq_lens[s]}"
            assert view.num_computed[s] == seg_pos[0], f"rank {rank} segment {s}: num_computed {view.num_computed[s]}"
        np.testing.assert_array_equal(view.block_table, b.block_table[rows])


@settings(max_examples=150, deadline=None)
@given(batches())
def test_kv_write_idx_writes_every_global_token_once(b: Batch) -> None:
    part = _partition(b)
    x = torch.randn(b.num_tokens, 3)
    gathered = _fake_all_gather(x, part)
    kv = part.kv_write_idx
    assert kv.shape == (b.num_tokens,) and len(np.unique(kv)) == b.num_tokens, "a gathered row is written twice"
    torch.testing.assert_close(gathered[torch.from_numpy(kv)], x, rtol=0, atol=0)
    decode = ~np.repeat(b.is_prefill, np.diff(b.query_start_loc))
    assert np.all(kv[decode] < part.max_local_tokens), "decode K/V must come from rank 0's copy"


def test_design_example_p2() -> None:
    # DESIGN §3: [A B | c0..c7], A and B one-token decodes, c0..c7 one prompt chunk; 2 padding tokens.
    part = partition(np.array([0, 1, 2, 10]), np.array([False, False, True]), pcp_size=2, num_padding=2)
    assert part.max_local_tokens == 6 and part.num_padding == 2
    np.testing.assert_array_equal(part.local_token_idx[0], [0, 1, 2, 3, 8, 9])  # A B c0 c1 c6 c7
    np.testing.assert_array_equal(part.local_token_idx[1], [0, 1, 4, 5, 6, 7])  # A B c2 c3 c4 c5
    for rank in range(2):
        np.testing.assert_array_equal(part.local_query_start_loc[rank], [0, 1, 2, 4, 6])
        np.testing.assert_array_equal(part.local_row_to_global_row[rank], [0, 1, 2, 2])
    np.testing.assert_array_equal(part.restore_idx, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, -1, -1])
    np.testing.assert_array_equal(part.kv_write_idx, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5])
    positions = np.array([9, 4, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0])
    block_table = np.array([[1, 2, 3], [4, 5, 0], [6, 7, 0]], dtype=np.int32)
    expected = {0: ([9, 4, 0, 1, 6, 7], [10, 5, 2, 8], [9, 4, 0, 6]),
                1: ([9, 4, 2, 3, 4, 5], [10, 5, 4, 6], [9, 4, 2, 4])}
    for rank, (pos, seq_lens, num_computed) in expected.items():
        view = local_metadata(part, rank, positions, block_table)
        np.testing.assert_array_equal(view.positions, pos)
        np.testing.assert_array_equal(view.seq_lens, seq_lens)
        np.testing.assert_array_equal(view.num_computed, num_computed)
        np.testing.assert_array_equal(view.block_table, block_table[[0, 1, 2, 2]])
    hidden = torch.arange(10, dtype=torch.float32)[:, None]
    np.testing.assert_array_equal(restore(_fake_all_gather(hidden, part), part)[:, 0].numpy(),
                                  list(range(10)) + [0, 0])


@settings(max_examples=50, deadline=None)
@given(batches())
def test_pcp1_partition_is_identity(b: Batch) -> None:
    part = partition(b.query_start_loc, b.is_prefill, 1, b.num_padding)
    np.testing.assert_array_equal(part.local_token_idx[0], np.arange(b.num_tokens))
    np.testing.assert_array_equal(part.local_query_start_loc[0], b.query_start_loc)
    np.testing.assert_array_equal(part.local_row_to_global_row[0], np.arange(len(b.is_prefill)))
    np.testing.assert_array_equal(part.restore_idx, [*range(b.num_tokens), *[-1] * b.num_padding])
    assert part.max_local_tokens == b.num_tokens


def test_short_prefill_row_leaves_high_ranks_empty() -> None:
    # 3 tokens over 2P = 8 chunks of 1: ranks 0..2 own chunk 0..2, rank 3 owns nothing.
    part = partition(np.array([0, 3]), np.array([True]), pcp_size=4)
    assert [len(idx) for idx in part.local_token_idx] == [1, 1, 1, 0]
    assert part.local_query_start_loc[3].tolist() == [0] and part.local_row_to_global_row[3].shape == (0,)
    view = local_metadata(part, 3, np.arange(3), np.zeros((1, 2), dtype=np.int32))
    assert view.seq_lens.shape == (0,) and view.block_table.shape == (0, 2)
    assert pad_local(torch.zeros(0, 5), part).shape == (1, 5)


@pytest.mark.parametrize("qsl, is_prefill, pcp_size, num_padding, field", [
    ([0, 2, 2], [True, False], 2, 0, "query_start_loc"),
    ([0, 2], [True, False], 2, 0, "is_prefill"),
    ([0, 2], [True], 0, 0, "pcp_size"),
    ([0, 2], [True], 2, -1, "num_padding"),
])
def test_bad_partition_input_names_the_field(qsl: list[int], is_prefill: list[bool], pcp_size: int,
                                             num_padding: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        partition(np.array(qsl), np.array(is_prefill), pcp_size, num_padding)


def test_pad_local_and_restore_reject_wrong_sizes() -> None:
    part = partition(np.array([0, 4]), np.array([True]), pcp_size=2)
    with pytest.raises(ValueError, match="max_local_tokens"):
        pad_local(torch.zeros(part.max_local_tokens + 1, 2), part)
    with pytest.raises(ValueError, match="pcp_size \\* max_local_tokens"):
        restore(torch.zeros(3, 2), part)


@settings(max_examples=150, deadline=None)
@given(batches(), st.data())
def test_restore_rows_equals_restore_then_index(b: Batch, data: st.DataObject) -> None:
    part = _partition(b)
    x = torch.randn(b.num_tokens + b.num_padding, 3)
    x[b.num_tokens:] = 0
    rows = np.array(data.draw(st.lists(st.integers(0, b.num_tokens + b.num_padding - 1), max_size=20)),
                    dtype=np.int64)
    plan = row_gather(part, rows)
    shares = torch.cat([select_rows(x[: b.num_tokens][torch.from_numpy(idx)], plan, r)
                        for r, idx in enumerate(part.local_token_idx)])  # what the all-gather concatenates
    assert plan.max_rows <= len(rows)  # never more than the requested rows per rank
    torch.testing.assert_close(restore_rows(shares, plan), x[torch.from_numpy(rows)], rtol=0, atol=0)
