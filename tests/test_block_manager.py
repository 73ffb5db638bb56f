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


def test_mtp_keys_a_block_by_its_tokens_and_the_next_one():
    """An MTP layer's cache entry at a block's last position was computed from the token after the block, so with an
    MTP drafter a block hits only when that token matches too, and is registered only once that token is known."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, key_next_token=True)
    a = _req(list(range(10)), "a")
    _compute_all(bm, a)
    assert len(a.block_hashes) == 2  # both full blocks: tokens 4 and 8 follow them
    b = _req(list(range(8)) + [99, 98, 97], "b")  # block 1 is equal but the token after it differs
    assert bm.match_prefix(b) == 4 and b.block_ids == a.block_ids[:1]
    assert bm.blocks[a.block_ids[0]].ref_count == 2 and bm.blocks[a.block_ids[1]].ref_count == 1
    c = _req(list(range(9)) + [77, 76], "c")  # the token after block 1 matches: both blocks hit
    assert bm.match_prefix(c) == 8 and c.block_ids == a.block_ids[:2]
    d = _req([50, 51, 52], "d")
    assert bm.match_prefix(d) == 0 and d.block_ids == []
    # a decode that fills a block waits for the token after it (sampled by that same step)
    e = _req(list(range(20, 28)), "e")
    assert bm.allocate(e, 9)
    e.num_computed_tokens = 7
    bm.cache_full_blocks(e, 8)  # this step computes position 7, the block's last; token 8 is not known yet
    assert len(e.block_hashes) == 1
    e.output_token_ids.append(28)  # the step sampled it
    e.num_computed_tokens = 8
    bm.cache_full_blocks(e, 9)
    assert len(e.block_hashes) == 2
    f = _req(list(range(20, 29)) + [5, 6], "f")
    assert bm.match_prefix(f) == 8
