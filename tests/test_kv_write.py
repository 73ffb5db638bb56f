"""write_kv: a step's new K/V rows written into their cache slots. When the step writes all its rows in order (one
rank, no padding) the rows go as they lie, not through a gathered copy; every other write_rows (a PCP layout's
permutation, a subset, padding left out) gathers them. Both must write the same slots with the same values."""

from __future__ import annotations

import torch

from tandem.attention.backends.prefix import write_kv, write_rows_leading
from tandem.attention.sharded_kv import ShardedAttentionMetadata


def _meta(write_rows: torch.Tensor, write_slots: torch.Tensor) -> ShardedAttentionMetadata:
    return ShardedAttentionMetadata(rows=[], write_rows=write_rows, write_slots=write_slots)


def test_write_kv_equals_the_gathered_write_for_every_kind_of_write_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        tokens = int(torch.randint(1, 40, (1,), generator=gen))
        new = torch.randn(tokens, 3, 8, generator=gen)[:, :, :5]  # a strided view, as k inside a fused qkv output
        kind = trial % 4
        if kind == 0:
            rows = torch.arange(tokens)  # one rank: every row in order
        elif kind == 1:
            rows = torch.randperm(tokens, generator=gen)  # a PCP layout's permutation
        elif kind == 2:
            rows = torch.arange(tokens)[torch.rand(tokens, generator=gen) < 0.6]  # padding rows left out
        else:
            rows = torch.arange(max(tokens - 1, 0))  # the leading rows only
        slots = torch.randperm(200, generator=gen)[: rows.numel()]
        meta = _meta(rows, slots)
        cache, want = torch.zeros(200, 3, 5), torch.zeros(200, 3, 5)
        want[slots] = new[rows]
        write_kv(cache, new, meta)
        assert torch.equal(cache, want), (trial, kind)
        in_order = rows.numel() > 0 and torch.equal(rows, torch.arange(rows.numel()))
        assert write_rows_leading(meta) == (rows.numel() if in_order else None), (trial, kind)


def test_the_leading_rows_check_follows_a_replaced_write_rows() -> None:
    meta = _meta(torch.arange(4), torch.arange(4))
    assert write_rows_leading(meta) == 4
    meta.write_rows = torch.tensor([1, 0, 2, 3])  # cached per tensor: a new one is checked again
    assert write_rows_leading(meta) is None
    cache = torch.zeros(4, 2)
    write_kv(cache, torch.arange(8.0).view(4, 2), meta)
    assert cache[:, 0].tolist() == [2.0, 0.0, 4.0, 6.0]
