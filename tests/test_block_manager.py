"""Block manager invariants: reference counts, prefix hits, eviction of freed cached blocks."""

from __future__ import annotations

from tandem.engine.block_manager import BlockManager
from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams


def _req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(), seed=0)


def _compute_all(bm: BlockManager, req: Request) -> None:
    assert bm.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req(list(range(10)), "a")
    _compute_all(bm, a)
    b = _req(list(range(8)) + [99, 98, 97], "b")
    assert bm.match_prefix(b) == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_ids[:2])
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_ids[:2])
    assert bm.num_free_blocks == 8 - 2


def test_freed_blocks_stay_cached_until_reallocated():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = _req(list(range(9)), "a")
    _compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = _req(list(range(9)), "again")
    assert bm.match_prefix(again) == 8, "freed blocks are revived by a later hit"
    bm.free(again)
    filler = _req(list(range(100, 116)), "filler")
    assert bm.allocate(filler, 16)
    late = _req(list(range(9)), "late")
    assert bm.match_prefix(late) == 0, "reallocated blocks must forget their hash"


def test_allocation_fails_without_side_effects_when_short():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = _req(list(range(12)))
    assert not bm.allocate(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def test_mtp_drops_the_last_hit_block():
    """An MTP layer's cache entry at the hit's last position holds the cached request's next token, so with an
    MTP drafter the last matched block is recomputed; dropping it leaves no extra reference behind."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, drop_last_hit_block=True)
    a = _req(list(range(10)), "a")
    _compute_all(bm, a)
    b = _req(list(range(8)) + [99, 98, 97], "b")
    assert bm.match_prefix(b) == 4 and b.block_ids == a.block_ids[:1]
    assert bm.blocks[a.block_ids[0]].ref_count == 2 and bm.blocks[a.block_ids[1]].ref_count == 1
    c = _req([50, 51, 52], "c")
    assert bm.match_prefix(c) == 0 and c.block_ids == []
