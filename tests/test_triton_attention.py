"""The Triton paged-attention kernel (tandem/attention/triton_paged.py), run by Triton's interpreter on CPU tensors,
against the explicit-scores reference (REFERENCE_SDPA's per-row attention with its log-sum-exp) on random paged
layouts: decode rows, verification rows and prompt chunks that start mid-prompt, partial blocks, rows with no
queries, graph padding, GQA ratios 1 / 3 / 8, head dims that are no power of two, MLA's 512 + 64 latent, 16-bit
and fp8 caches, and owner-sharded KV (each rank's partial merged by LSE equals one rank's attention). Then the
TRITON_ATTN / TRITON_MLA backends in the engine: Hugging Face's greedy tokens, and PCP's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import random_prompts
from hf_oracle import hf_greedy

from tandem import LLM, SamplingParams
from tandem.attention.backends.reference_sdpa import row_attention_with_lse
from tandem.attention.batch import AttentionBatch, KVShard
from tandem.attention.sharded_kv import merge_partials
from tandem.attention.triton_paged import MAX_SPLITS, num_key_splits, paged_attention, plan_tiles, triton_metadata

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def random_layout(rng: np.random.Generator, rows: list[tuple[int, int]], block_size: int, num_blocks: int,
                  pad_tokens: int = 0) -> AttentionBatch:
    """rows: (num_queries, seq_len) each, the queries at the row's last positions; blocks drawn at random without
    replacement (so any rank may own any of them); `pad_tokens` trailing tokens in no row (graph padding)."""
    max_blocks = max(-(-s // block_size) for _, s in rows)
    perm = rng.permutation(num_blocks)
    table = np.zeros((len(rows), max_blocks), np.int32)
    used = 0
    positions, qsl = [], [0]
    for i, (n, s) in enumerate(rows):
        need = -(-s // block_size)
        table[i, :need] = perm[used:used + need]
        used += need
        positions += list(range(s - n, s))
        qsl.append(qsl[-1] + n)
    positions += [0] * pad_tokens
    return AttentionBatch(positions=torch.tensor(positions, dtype=torch.int64),
                          query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
                          seq_lens_cpu=torch.tensor([s for _, s in rows], dtype=torch.int32),
                          block_table=torch.from_numpy(table), block_size=block_size,
                          write_rows=torch.zeros(0, dtype=torch.int64), write_slots=torch.zeros(0, dtype=torch.int64))


def reference(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, batch: AttentionBatch, scale: float,
              value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: its keys' slots through the block table, explicit scores in float64 -> (out, lse)."""
    out = torch.zeros(q.shape[0], q.shape[1], value_dim, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    qsl = batch.query_start_loc_cpu.tolist()
    for i in range(len(qsl) - 1):
        a, b = qsl[i], qsl[i + 1]
        if b == a:
            continue
        pos = torch.arange(int(batch.seq_lens_cpu[i]))
        slots = batch.block_table[i, pos // batch.block_size].long() * batch.block_size + pos % batch.block_size
        o, l_ = row_attention_with_lse(q[a:b].double(), k_flat[slots].double(), v_flat[slots, :, :value_dim].double(),
                                       batch.positions[a:b], scale)
        out[a:b], lse[a:b] = o, l_.double()
    return out, lse


def cache(num_slots: int, heads: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, heads, width, generator=g).to(dtype)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
LAYOUTS = {
    "decodes": [(1, 1), (1, 17), (1, 64), (1, 33)],  # one query each, partial last blocks
    "verify": [(4, 20), (4, 4), (3, 47)],  # a few queries at the end of each row
    "chunks": [(24, 24), (13, 40), (0, 9), (37, 70)],  # prompt chunks, one starting at position 27; an empty row
    "mixed": [(1, 50), (29, 29), (4, 12), (1, 2)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (6, 2, 40), (16, 2, 64)])  # GQA 1 / 3 / 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gqa_matches_the_reference(layout, heads, kv_heads, head_dim, dtype):
    rng = np.random.default_rng(hash((layout, heads, head_dim)) % 2**32)
    block_size = 16 if heads != 6 else 5  # a block size no power of two
    batch = random_layout(rng, LAYOUTS[layout], block_size, num_blocks=64, pad_tokens=3)
    num_slots = 64 * block_size
    k, v = cache(num_slots, kv_heads, head_dim, dtype, 1), cache(num_slots, kv_heads, head_dim, dtype, 2)
    q = torch.randn(batch.positions.shape[0], heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    scale = head_dim ** -0.5
    meta = triton_metadata(batch)
    out, _ = paged_attention(q, k, v, meta, scale, head_dim)
    out_lse, lse = paged_attention(q, k, v, meta, scale, head_dim, with_lse=True)
    ref, ref_lse = reference(q, k, v, batch, scale, head_dim)
    assert out.dtype == dtype and out_lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out_lse.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    assert out[-3:].abs().max() == 0, "graph padding (tokens in no row) stays zero"


@pytest.mark.parametrize("heads", [16, 20])  # 20: a head tile left partial
@pytest.mark.parametrize("layout", ["decodes", "mixed"])
def test_mla_latent_matches_the_reference(heads, layout):
    """MLA absorbed: MQA of [q_latent | q_pe] (512 + 64) over the latent cache, the values its first 512 channels."""
    rng = np.random.default_rng(heads)
    batch = random_layout(rng, LAYOUTS[layout], 16, num_blocks=32)
    latent = cache(32 * 16, 1, 576, torch.bfloat16, 4)
    q = torch.randn(batch.positions.shape[0], heads, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    scale = 192 ** -0.5
    out, lse = paged_attention(q, latent, latent, triton_metadata(batch), scale, 512, rope_dim=64, with_lse=True)
    ref, ref_lse = reference(q, latent, latent, batch, scale, 512)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_reads_as_its_stored_values(cache_dtype):
    """An fp8 cache is read as the values it stores (the layer folds the scales around the backend)."""
    rng = np.random.default_rng(7)
    batch = random_layout(rng, LAYOUTS["mixed"], 16, num_blocks=32)
    k8, v8 = cache(512, 2, 64, cache_dtype, 8), cache(512, 2, 64, cache_dtype, 9)
    q = torch.randn(batch.positions.shape[0], 4, 64, generator=torch.Generator().manual_seed(10)).bfloat16()
    out, _ = paged_attention(q, k8, v8, triton_metadata(batch), 0.125, 64)
    ref, _ = reference(q, k8.float(), v8.float(), batch, 0.125, 64)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pcp_size", [2, 3])
def test_owner_sharded_partials_merge_to_one_ranks_attention(pcp_size):
    """Each rank's cache holds only its own blocks (global block b at local b // P on rank b % P); the ranks'
    partials merged by log-sum-exp equal attention over the whole cache."""
    rng = np.random.default_rng(pcp_size)
    block_size, num_blocks = 8, 48
    batch = random_layout(rng, LAYOUTS["mixed"] + [(1, 3)], block_size, num_blocks)  # (1, 3): one block, one owner
    k, v = cache(num_blocks * block_size, 2, 32, torch.float32, 11), cache(num_blocks * block_size, 2, 32,
                                                                          torch.float32, 12)
    q = torch.randn(batch.positions.shape[0], 4, 32, generator=torch.Generator().manual_seed(13))
    outs, lses = [], []
    for rank in range(pcp_size):
        blocks = torch.arange(rank, num_blocks, pcp_size)  # the global blocks this rank owns, in local order
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        batch.kv_shard = KVShard(rank, pcp_size)
        o, lse = paged_attention(q, k[slots], v[slots], triton_metadata(batch), 0.2, 32, with_lse=True)
        outs.append(o)
        lses.append(lse)
    assert any(bool(torch.isinf(lse).any()) for lse in lses), "some query owns no key on some rank"
    batch.kv_shard = None
    ref, _ = reference(q, k, v, batch, 0.2, 32)
    torch.testing.assert_close(merge_partials(torch.stack(outs), torch.stack(lses)).double(), ref, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("mla", [False, True])
def test_split_kv_partials_merge_to_the_same_attention(num_splits, mla):
    """Split-KV (what a GPU launches for a grid too small to fill it): the key range cut over programs, partials
    merged by log-sum-exp; splits past a short row's keys see nothing. Same output and log-sum-exp as the reference."""
    rng = np.random.default_rng(num_splits)
    batch = random_layout(rng, [(1, 150), (1, 3), (4, 97), (0, 5)], 16, num_blocks=32, pad_tokens=1)
    heads, kv_heads, width, dv, rope = (16, 1, 576, 512, 64) if mla else (6, 2, 64, 64, 0)
    k = cache(512, kv_heads, width, torch.bfloat16, 14)
    v = k if mla else cache(512, kv_heads, width, torch.bfloat16, 15)
    q = torch.randn(batch.positions.shape[0], heads, width, generator=torch.Generator().manual_seed(16)).bfloat16()
    meta = triton_metadata(batch)
    out, _ = paged_attention(q, k, v, meta, 0.1, dv, rope_dim=rope, num_splits=num_splits)
    out_lse, lse = paged_attention(q, k, v, meta, 0.1, dv, rope_dim=rope, with_lse=True, num_splits=num_splits)
    ref, ref_lse = reference(q, k, v, batch, 0.1, dv)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_lse.double(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)
    assert out[-1].abs().max() == 0


def test_split_count_fills_a_small_grid_only_on_a_gpu():
    assert num_key_splits(8, 2048, on_gpu=True) == 8  # batch-1 decode, 8 KV heads, 2k keys: 256-key splits
    assert num_key_splits(8, 100_000, on_gpu=True) == MAX_SPLITS
    assert num_key_splits(8, 200, on_gpu=True) == 1  # too few keys to split
    assert num_key_splits(1024, 8192, on_gpu=True) == 1  # the grid already fills the GPU
    assert num_key_splits(8, 8192, on_gpu=False) == 1


def test_tiles_cover_every_query_once():
    qsl = np.array([0, 1, 1, 40, 44, 107], np.int32)
    for block_q in (1, 4, 16, 64):
        tile_row, tile_start = plan_tiles(qsl, block_q)
        covered = sorted(t for r, a in zip(tile_row, tile_start, strict=True)
                         for t in range(a, min(a + block_q, qsl[r + 1])))
        assert covered == list(range(qsl[-1]))


@pytest.mark.parametrize("arch,backend", [("llama", "TRITON_ATTN"), ("deepseek_v3", "TRITON_MLA")])
def test_engine_with_triton_backend_matches_hf_and_pcp(tiny_checkpoints, arch, backend):
    """The backends in the engine: HF's greedy tokens at one rank, and the same tokens at PCP = 2 in both KV
    layouts (sharded: each rank's partials over its own blocks, merged by LSE)."""
    path = str(tiny_checkpoints(arch))
    prompts = random_prompts([5, 19, 33], vocab_size=500, seed=23)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    for kwargs in ({}, {"prefill_context_parallel_size": 2},
                   {"prefill_context_parallel_size": 2, "pcp_kv_layout": "sharded"}):
        llm = LLM(path, dtype="float32", attention_config={"backend": backend}, **kwargs)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs


def test_mtp_drafts_through_triton_mla_losslessly(tiny_checkpoints):
    """MTP's draft decodes attend through the backend too (verification rows of K + 1 queries, draft decodes moved
    on a position at a time): greedy with K = 2 equals no-spec greedy, on one rank and PCP = 2 (the drafter
    sharded, since TRITON_MLA supports PCP)."""
    path = str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1))
    prompts = random_prompts([7, 26, 41], vocab_size=500, seed=29)
    tokens = {}
    for name, kwargs in {"no-spec": {}, "mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
                         "mtp pcp2": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
                                      "prefill_context_parallel_size": 2}}.items():
        llm = LLM(path, dtype="float32", attention_config={"backend": "TRITON_MLA"}, **kwargs)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["mtp"] == tokens["no-spec"] and tokens["mtp pcp2"] == tokens["no-spec"]


def test_fp8_cache_through_triton_matches_the_paged_backend(tiny_checkpoints):
    """Both backends read the same stored fp8 values (the scales folded around them): the same greedy tokens."""
    path = str(tiny_checkpoints("llama"))
    prompts = random_prompts([9, 30], vocab_size=500, seed=31)
    tokens = []
    for backend in ("PAGED_SDPA", "TRITON_ATTN"):
        llm = LLM(path, dtype="float32", kv_cache_dtype="fp8_e4m3", attention_config={"backend": backend})
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]
