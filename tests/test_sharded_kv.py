"""Owner-sharded PCP KV (pcp_kv_layout sharded) in one process: the ownership rule partitions every row's keys
over the ranks, the per-rank block pools follow it, and the per-rank partial attentions over owned keys merge by
LSE to the unsplit attention (GQA, MLA absorbed and expanded; decode, verification and prompt-chunk rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.attention.backends.paged_mla import PagedMLABackend
from tandem.attention.backends.paged_sdpa import PagedSDPABackend
from tandem.attention.kv_ownership import local_slots, owned_plan, owned_writes, owner_rank
from tandem.attention.mla import MLAUpProjection, absorb
from tandem.attention.sharded_kv import ShardedAttentionMetadata, merge_partials
from tandem.engine.block_manager import BlockManager
from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams


def _layout(rng: np.random.Generator, pcp: int, block_size: int, seq_lens: list[int], blocks_per_rank: int
            ) -> np.ndarray:
    """A block table [R, max_blocks] of distinct global ids: odd rows as the allocator places them (the j-th
    block from pool j % P, ascending ids), even rows anywhere at random (the rule must hold whoever placed a
    block)."""
    free = [list(range(p, pcp * blocks_per_rank, pcp)) for p in range(pcp)]
    width = max(-(-s // block_size) for s in seq_lens)
    table = np.zeros((len(seq_lens), width), dtype=np.int64)
    for i, s in enumerate(seq_lens):
        for j in range(-(-s // block_size)):
            if i % 2:
                table[i, j] = free[j % pcp].pop(0)
            else:
                pool = free[int(rng.integers(pcp))] or max(free, key=len)
                table[i, j] = pool.pop(int(rng.integers(len(pool))))
    return table


@settings(max_examples=60, deadline=None)
@given(pcp=st.integers(2, 4), block_size=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 10_000),
       rows=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 40)), min_size=1, max_size=5))
def test_ownership_rule_partitions_every_rows_keys(pcp, block_size, seed, rows):
    """Every key a row sees lies on exactly one rank, at the local slot the rule names; shared keys are the ones
    before the row's first query and diag visibility is position order."""
    rng = np.random.default_rng(seed)
    seq_lens = [s + q for s, q in rows]
    num_q = [q for _, q in rows]
    qsl = np.concatenate([[0], np.cumsum(num_q)])
    positions = np.concatenate([np.arange(s, s + q) for s, q in rows])
    table = _layout(rng, pcp, block_size, seq_lens, blocks_per_rank=sum(seq_lens) // block_size + 8)
    per_rank = [owned_plan(positions, qsl, np.array(seq_lens), table, block_size, r, pcp, "cpu",
                           batch_short_rows=False)[1] for r in range(pcp)]
    for i, (start, q) in enumerate(rows):
        seen: list[tuple[int, int]] = []  # (rank, local slot) of every owned key of row i
        for r in range(pcp):
            row = per_rank[r][i]
            assert row.token_start == qsl[i] and row.num_queries == q
            shared = row.shared_slots().tolist()
            assert len(shared) == row.num_shared and len(set(shared)) == len(shared)
            diag = row.diag_slots.tolist()
            seen += [(r, s) for s in shared + diag]
            pos = np.arange(seq_lens[i])
            expect_owner = owner_rank(table[i, pos // block_size], pcp)
            mine = pos[expect_owner == r]
            expect = local_slots(table[i, mine // block_size] * block_size + mine % block_size, block_size, pcp)
            assert sorted(shared) == sorted(expect[mine < start].tolist())
            assert diag == expect[mine >= start].tolist()
            diag_pos = mine[mine >= start]
            q_pos = start + np.arange(q)
            assert torch.equal(row.diag_visible, torch.from_numpy(q_pos[:, None] >= diag_pos[None, :]))
        assert len(seen) == seq_lens[i] and len(set(seen)) == seq_lens[i], "a key on no rank or on two"
    slots = table[0, :1] * block_size
    for r in range(pcp):
        keep, local = owned_writes(slots, block_size, r, pcp)
        assert (len(keep) == 1) == (owner_rank(int(table[0, 0]), pcp) == r)


@settings(max_examples=40, deadline=None)
@given(pcp=st.integers(2, 4), block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 10_000),
       rows=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 700)), min_size=1, max_size=4))
def test_split_keys_over_a_replicated_cache_partition_and_balance_every_row(pcp, block_size, seed, rows):
    """The replicated layout's prompt steps (split_prompt_keys): each key a row sees is attended on exactly one rank,
    at its own (global) slot, whatever block ids one pool handed out; the ranks' shares differ by at most a block;
    a chunk of diag queries attends exactly the diag keys its last query sees."""
    rng = np.random.default_rng(seed)
    seq_lens = [s + q for s, q in rows]
    qsl = np.concatenate([[0], np.cumsum([q for _, q in rows])])
    positions = np.concatenate([np.arange(s, s + q) for s, q in rows])
    width = max(-(-n // block_size) for n in seq_lens)
    table = rng.permutation(len(rows) * width).reshape(len(rows), width)  # any ids: one pool, no parity
    per_rank = [owned_plan(positions, qsl, np.array(seq_lens), table, block_size, r, pcp, "cpu",
                           batch_short_rows=False, replicated=True)[1] for r in range(pcp)]
    for i, n in enumerate(seq_lens):
        pos = np.arange(n)
        glob = table[i, pos // block_size] * block_size + pos % block_size
        seen = sorted(s for r in range(pcp) for s in per_rank[r][i].shared_slots().tolist()
                      + per_rank[r][i].diag_slots.tolist())
        assert seen == sorted(glob.tolist()), "a key on no rank or on two"
        counts = [per_rank[r][i].num_shared + per_rank[r][i].diag_slots.shape[0] for r in range(pcp)]
        assert max(counts) - min(counts) <= block_size
        for r in range(pcp):
            row = per_rank[r][i]
            for a, b, n in row.diag_chunks:
                assert n == int(row.diag_visible[b - 1].sum()) and not row.diag_visible[a:b, n:].any()


def test_block_pools_take_a_requests_blocks_round_robin():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, num_pools=3)
    assert bm.pool_free_blocks() == [4, 4, 4]
    a = Request("a", list(range(21)), SamplingParams(), seed=0)  # 6 blocks: 2 from each pool
    assert bm.allocate(a, a.num_tokens)
    assert [b % 3 for b in a.block_ids] == [0, 1, 2, 0, 1, 2]
    assert bm.pool_free_blocks() == [2, 2, 2]
    big = Request("big", list(range(29)), SamplingParams(), seed=0)  # 8 blocks: 3 from pools 0 and 1
    assert not bm.allocate(big, big.num_tokens), "pools 0 and 1 hold only 2 free blocks each"
    assert big.block_ids == [] and bm.num_free_blocks == 6
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b = Request("b", list(range(16)) + [99, 98], SamplingParams(), seed=0)
    assert bm.match_prefix(b) == 16 and b.block_ids == a.block_ids[:4]  # hits keep their index, so their pool
    assert bm.allocate(b, b.num_tokens) and b.block_ids[4] % 3 == 1
    bm.free(a)
    bm.free(b)
    assert bm.pool_free_blocks() == [4, 4, 4]
    with pytest.raises(ValueError, match="multiple of num_pools"):
        BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False, num_pools=3)


@settings(max_examples=40, deadline=None)
@given(parts=st.integers(1, 5), seed=st.integers(0, 10_000), empty=st.booleans())
def test_lse_merge_of_random_key_splits_is_the_unsplit_attention(parts, seed, empty):
    """Attention over a key set split at random into `parts` disjoint sets (one of them empty when `empty`)
    merges to the attention over the whole set within 1e-5."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 5, 8, generator=g), torch.randn(3, 40, 8, generator=g), torch.randn(3, 40, 6, generator=g)
    owner = torch.randint(0, parts + int(empty), (40,), generator=g)
    outs, lses = [], []
    for p in range(parts + int(empty)):
        keys = (owner == p).nonzero().squeeze(1)
        scores = (q @ k[:, keys].transpose(-1, -2)) * 0.3
        lse = torch.logsumexp(scores, -1) if keys.numel() else torch.full(q.shape[:2], float("-inf"))
        outs.append(scores.softmax(-1) @ v[:, keys] if keys.numel() else torch.zeros(3, 5, 6))
        lses.append(lse)
    expected = ((q @ k.transpose(-1, -2)) * 0.3).softmax(-1) @ v
    torch.testing.assert_close(merge_partials(torch.stack(outs), torch.stack(lses)), expected, atol=1e-5, rtol=1e-5)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Dense causal attention: q [Q, Hq, D] at q_pos over keys/values [S, Hkv, D*] at positions 0..S-1."""
    r = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(r, dim=1), values.repeat_interleave(r, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * scale
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


ROWS = [(0, 40), (37, 1), (100, 4), (4200, 3), (1200, 24), (300, 600)]  # (first query position, queries): chunks,
# decodes, verification rows, a decode long enough to read its keys in place, and a chunk whose diag queries
# are attended in several pieces (sharded_kv.DIAG_CHUNK)


def _sharded(pcp: int, block_size: int, seed: int):
    """Every row's keys at global positions, a global block table, and per rank its local cache slot of each
    key: returns (seq_lens, positions, qsl, table, per-rank metadata builder)."""
    rng = np.random.default_rng(seed)
    seq_lens = [s + q for s, q in ROWS]
    table = _layout(rng, pcp, block_size, seq_lens, blocks_per_rank=sum(seq_lens) // block_size + 8)
    qsl = np.concatenate([[0], np.cumsum([q for _, q in ROWS])])
    positions = np.concatenate([np.arange(s, s + q) for s, q in ROWS])
    return seq_lens, positions, qsl, table


def _meta(plan) -> ShardedAttentionMetadata:
    groups, rows = plan
    none = torch.zeros(0, dtype=torch.int64)
    return ShardedAttentionMetadata(rows, none, none, groups=groups)


def _fill_caches(keys: torch.Tensor, table: np.ndarray, seq_lens: list[int], block_size: int, pcp: int,
                 slots_per_rank: int) -> list[torch.Tensor]:
    """keys [R, S_max, ...] per row -> per rank its local flat cache [slots, ...] holding the keys it owns."""
    caches = [keys.new_zeros(slots_per_rank, *keys.shape[2:]) for _ in range(pcp)]
    for i, s in enumerate(seq_lens):
        pos = np.arange(s)
        glob = table[i, pos // block_size] * block_size + pos % block_size
        for r in range(pcp):
            mine = owner_rank(glob // block_size, pcp) == r
            caches[r][torch.from_numpy(local_slots(glob[mine], block_size, pcp))] = keys[i, torch.from_numpy(pos[mine])]
    return caches


@pytest.mark.parametrize("pcp,block_size", [(2, 16), (3, 4), (4, 1)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_gqa_partials_over_owned_keys_merge_to_full_attention(pcp, block_size, hq, hkv):
    seq_lens, positions, qsl, table = _sharded(pcp, block_size, seed=pcp * 10 + hkv)
    g = torch.Generator().manual_seed(0)
    d, s_max = 8, max(seq_lens)
    k_all = torch.randn(len(ROWS), s_max, hkv, d, generator=g)
    v_all = torch.randn(len(ROWS), s_max, hkv, d, generator=g)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    slots = (table.max() // pcp + 1) * block_size
    kv = [torch.stack(p) for p in zip(_fill_caches(k_all, table, seq_lens, block_size, pcp, slots),
                                      _fill_caches(v_all, table, seq_lens, block_size, pcp, slots), strict=True)]
    outs, lses = [], []
    for r in range(pcp):
        groups, rows = owned_plan(positions, qsl, np.array(seq_lens), table, block_size, r, pcp, "cpu")
        # the decode and short verification rows batched; the long verification row in place; chunks one by one
        assert groups and groups[0].token_idx.shape[0] == 2
        assert [row.num_queries for row in rows] == [40, 3, 24, 600] and rows[1].runs
        cache = kv[r].view(2, -1, 1, hkv, d)  # [2, num_blocks, block_size=1, Hkv, D]: flatten(0, 1) = the slots
        o, lse = PagedSDPABackend.forward_sharded(q, q.new_zeros(0, hkv, d), q.new_zeros(0, hkv, d), cache,
                                                  _meta((groups, rows)), 0.3)
        one_by_one = owned_plan(positions, qsl, np.array(seq_lens), table, block_size, r, pcp, "cpu",
                                batch_short_rows=False)[1]
        o1, lse1 = PagedSDPABackend.forward_sharded(q, q.new_zeros(0, hkv, d), q.new_zeros(0, hkv, d), cache,
                                                    _meta(([], one_by_one)), 0.3)
        torch.testing.assert_close(o, o1, atol=1e-5, rtol=1e-5)  # the batched group == each row alone
        torch.testing.assert_close(lse, lse1, atol=1e-5, rtol=1e-5)
        outs.append(o)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    for i, (start, n) in enumerate(ROWS):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        expected = _reference(q[rows], k_all[i, : seq_lens[i]], v_all[i, : seq_lens[i]],
                              torch.arange(start, start + n), 0.3)
        torch.testing.assert_close(merged[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pcp,block_size", [(2, 16), (4, 4)])
@pytest.mark.parametrize("lora", [16, 512])  # at 16 the chunks' keys are expanded, at 512 absorbed
@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
def test_mla_partials_over_owned_latents_merge_to_full_attention(pcp, block_size, lora, replicated):
    """Sharded KV; and `replicated`: every rank holds every latent at its global slot and attends its split of
    each row's keys (the replicated layout's prompt steps)."""
    seq_lens, positions, qsl, table = _sharded(pcp, block_size, seed=7)
    g = torch.Generator().manual_seed(1)
    heads, nope, rope, v_dim = 4, 8, 4, 8
    up = MLAUpProjection(w_uk=torch.randn(heads, nope, lora, generator=g) / lora ** 0.5,
                         w_uv=torch.randn(heads, v_dim, lora, generator=g) / lora ** 0.5)
    latents = torch.randn(len(ROWS), max(seq_lens), lora + rope, generator=g)
    q_nope = torch.randn(int(qsl[-1]), heads, nope, generator=g)
    q_pe = torch.randn(int(qsl[-1]), heads, rope, generator=g)
    slots = (table.max() // pcp + 1) * block_size
    if replicated:
        full = latents.new_zeros((table.max() + 1) * block_size, lora + rope)
        for i, n in enumerate(seq_lens):
            pos = np.arange(n)
            full[torch.from_numpy(table[i, pos // block_size] * block_size + pos % block_size)] = latents[i, :n]
        caches = [full] * pcp
    else:
        caches = _fill_caches(latents, table, seq_lens, block_size, pcp, slots)
    outs, lses = [], []
    for r in range(pcp):
        plan = owned_plan(positions, qsl, np.array(seq_lens), table, block_size, r, pcp, "cpu", replicated=replicated)
        assert plan[0], "the short rows are batched"
        o, lse = PagedMLABackend.forward_mla_sharded(torch.cat((q_nope, q_pe), -1), latents.new_zeros(0, lora + rope),
                                                     caches[r].view(-1, 1, lora + rope), _meta(plan),
                                                     0.25, up)
        outs.append(o)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    for i, (start, n) in enumerate(ROWS):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        lat = latents[i, : seq_lens[i]]
        q_abs = absorb(q_nope[rows], q_pe[rows], up)  # [Q, H, L + R]: MQA over the latents, values their first L
        o_latent = _reference(q_abs, lat[:, None], lat[:, None, :lora], torch.arange(start, start + n), 0.25)
        expected = torch.einsum("qhl,hvl->qhv", o_latent, up.w_uv)
        torch.testing.assert_close(merged[rows], expected, atol=1e-4, rtol=1e-4)
