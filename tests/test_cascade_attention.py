"""Cascade attention (metadata.SharedPrefix): short rows whose block tables start with the same blocks attend those
keys once for all their queries and merge with their own keys by LSE. Checked against a per-row dense causal
reference on random paged caches (GQA with values, MLA-style latents with the values inside the keys), over
gathered and in-place reads, consecutive and scattered shared blocks, beside a prompt chunk, and end to end:
greedy tokens of a batch sharing a cached prefix equal the same prompts run alone, with and without MTP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import random_prompts

from tandem import LLM, SamplingParams, native
from tandem.attention.backends.prefix import prefix_attention
from tandem.attention.metadata import build_attention_metadata

BLOCK = 16


def _layout(q_lens: list[int], seq_lens: list[int], shared_blocks: int, scattered: bool, seed: int,
            outsiders: int = 0) -> tuple[np.ndarray, int]:
    """A block table whose rows share their first `shared_blocks` blocks (consecutive ids or scattered ones) and
    then own distinct blocks; the last `outsiders` rows share nothing; -> (table [R, max_blocks] int32, number of
    blocks in the pool)."""
    rng = np.random.default_rng(seed)
    need = [-(-s // BLOCK) for s in seq_lens]
    own = [n - (shared_blocks if i < len(q_lens) - outsiders else 0) for i, n in enumerate(need)]
    pool = shared_blocks + sum(own) + 8
    ids = rng.permutation(pool) if scattered else np.arange(pool)
    table = np.zeros((len(q_lens), max(need)), dtype=np.int32)
    nxt = shared_blocks
    for i, n in enumerate(need):
        first = n - own[i]
        table[i, :first] = ids[:first]
        table[i, first:n] = ids[nxt: nxt + own[i]]
        nxt += own[i]
    return table, pool


def _reference(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, table: np.ndarray, q_lens: list[int],
               seq_lens: list[int], scale: float) -> torch.Tensor:
    """Per row: its queries at the last q_len positions of seq_len keys, causal, dense, in float64."""
    outs = []
    start = 0
    hq, hkv = q.shape[1], k_flat.shape[1]
    for i, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = np.arange(s)
        slots = torch.from_numpy(table[i, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
        k = k_flat[slots].double().repeat_interleave(hq // hkv, dim=1)  # [S, Hq, Dk]
        v = v_flat[slots].double().repeat_interleave(hq // hkv, dim=1)
        qi = q[start: start + n].double()  # [n, Hq, Dk]
        scores = torch.einsum("qhd,shd->hqs", qi, k) * scale
        q_pos = torch.arange(s - n, s)
        scores = scores.masked_fill(torch.arange(s)[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), v))
        start += n
    return torch.cat(outs).float()


def _attend(q, k_flat, v_flat, table, q_lens, seq_lens, scale, value_dims=None):
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens, strict=True)])
    meta = build_attention_metadata(positions, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                    torch.from_numpy(table), BLOCK, torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(0, dtype=torch.int64))
    v = None if value_dims is not None else v_flat
    return prefix_attention(q, k_flat, v, meta, scale, value_dims=value_dims), meta


CASES = [  # (q_lens, seq_lens, shared blocks, rows at the end that share nothing)
    ([1, 1, 1, 1], [330, 341, 352, 400], 20, 0),  # a batch of decodes over a 320-key shared prefix
    ([4, 4, 1], [336, 390, 329], 20, 0),  # verification rows of K + 1 = 4 and a decode
    ([1, 40, 4], [333, 40, 360], 20, 0),  # a prompt chunk (a long row, no shared keys) beside two short rows
    ([1, 4, 1, 1], [330, 350, 341, 90], 20, 2),  # two rows behind the prefix, two decodes of other requests
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("reads", ["gather", "in_place", "native"])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("mla", [False, True])
def test_shared_prefix_attention_equals_dense_causal_reference(monkeypatch, request, case, reads, scattered, mla):
    if reads == "native":
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setitem(native._state, "ok", False)
    if reads == "in_place":
        monkeypatch.setattr("tandem.attention.metadata.IN_PLACE_MIN_KEYS", 0)
        monkeypatch.setattr("tandem.attention.metadata.MIN_RUN_KEYS", 16)
    elif reads == "gather":
        monkeypatch.setattr("tandem.attention.metadata.IN_PLACE_MIN_KEYS", 10**9)
        monkeypatch.setattr("tandem.attention.metadata.GATHER_MAX_KEYS", 10**9)
    q_lens, seq_lens, shared, outsiders = CASES[case]
    if case == 2:  # the chunk is its own request: it shares nothing with the short rows
        table, pool = _layout([q_lens[0], q_lens[2]], [seq_lens[0], seq_lens[2]], shared, scattered, seed=case)
        own = np.zeros((1, table.shape[1]), dtype=np.int32)
        own[0, : -(-seq_lens[1] // BLOCK)] = np.arange(pool, pool + -(-seq_lens[1] // BLOCK))
        table = np.concatenate([table[:1], own, table[1:]])
        pool += -(-seq_lens[1] // BLOCK)
    else:
        table, pool = _layout(q_lens, seq_lens, shared, scattered, seed=case, outsiders=outsiders)
    g = torch.Generator().manual_seed(case)
    hq, hkv, dk, dv = (4, 1, 24, 16) if mla else (4, 2, 16, 8)
    k_flat = torch.randn(pool * BLOCK, hkv, dk, generator=g)
    v_flat = k_flat[..., :dv] if mla else torch.randn(pool * BLOCK, hkv, dv, generator=g)
    q = torch.randn(sum(q_lens), hq, dk, generator=g)
    want = _reference(q, k_flat, v_flat, table, q_lens, seq_lens, 0.25)
    got, meta = _attend(q, k_flat, v_flat, table, q_lens, seq_lens, 0.25, value_dims=dv if mla else None)
    assert meta.shared_prefix is not None and meta.shared_prefix.num_keys == shared * BLOCK
    assert (meta.shared_prefix.first_slot is None) == scattered
    members = len(q_lens) - outsiders - (1 if case == 2 else 0)  # the prompt chunk is no member
    token_idx = meta.shared_prefix.token_idx
    assert (token_idx is None) == (members == len(q_lens))
    if token_idx is not None:
        assert token_idx.numel() == sum(q_lens[:2] if case == 3 else [q_lens[0], q_lens[2]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr("tandem.attention.metadata.CASCADE_MIN_KEYS", 10**9)  # the same step without cascade
    plain, meta = _attend(q, k_flat, v_flat, table, q_lens, seq_lens, 0.25, value_dims=dv if mla else None)
    assert meta.shared_prefix is None
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_no_shared_prefix_when_rows_differ_one_row_or_too_few_keys():
    def shared(q_lens, seq_lens, table):
        qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens, strict=True)])
        return build_attention_metadata(positions, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                        torch.from_numpy(table), BLOCK, torch.zeros(0, dtype=torch.int64),
                                        torch.zeros(0, dtype=torch.int64)).shared_prefix

    table, _ = _layout([1, 1], [400, 400], 20, False, 0)
    assert shared([1, 1], [400, 400], table).num_keys == 320
    assert shared([1], [400], table[:1]) is None  # one row: nothing to share
    short_table, _ = _layout([1, 1], [400, 400], 15, False, 0)
    assert shared([1, 1], [400, 400], short_table) is None  # 240 shared keys < CASCADE_MIN_KEYS
    # the shared blocks must end before every row's first query: a row whose queries start inside them limits it
    assert shared([1, 1], [400, 300], table).num_keys == 288  # (300 - 1) // 16 = 18 whole blocks
    disjoint, _ = _layout([1, 1], [400, 400], 0, False, 0)
    assert shared([1, 1], [400, 400], disjoint) is None
    mixed, _ = _layout([1, 1, 1], [400, 400, 400], 20, False, 0, outsiders=1)
    assert shared([1, 1, 1], [400, 400, 400], mixed).num_keys == 320  # the two rows behind it, not the third
    assert shared([1, 1, 1], [400, 400, 400], mixed).token_idx.tolist() == [0, 1]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch,spec,tails", [("llama", None, "short"), ("deepseek_v3", None, "short"),
                                             ("deepseek_v3", {"method": "mtp", "num_speculative_tokens": 3}, "short"),
                                             ("deepseek_v3", None, "long")])
def test_batch_sharing_a_cached_prefix_gives_the_tokens_of_each_prompt_alone(tiny_checkpoints, monkeypatch,
                                                                             arch, spec, tails):
    """short: the prompts' new tokens are short rows (cascade; MLA attends the prefix absorbed on its first step and
    in its kept expanded form after, tandem/attention/expanded_prefix.py); long: prompt chunks of > 16 tokens, whose
    shared prefix MLA expands once a layer for all of them (expanded attention forced on). A fifth request with a
    prefix of its own runs beside them (its rows are padded apart, without the shared prefix)."""
    monkeypatch.setattr("tandem.attention.metadata.CASCADE_MIN_KEYS", 64)  # the tiny checkpoints' short contexts
    import tandem.attention.backends.paged_mla as mla_mod
    import tandem.attention.backends.prefix as prefix_mod

    merges = []
    real_merge = prefix_mod._merge_shared_prefix
    monkeypatch.setattr(prefix_mod, "_merge_shared_prefix", lambda *a: merges.append(1) or real_merge(*a))
    import tandem.attention.expanded_prefix as expanded_mod

    kept = []  # MLA decode steps that attended the prefix in its kept expanded form (from its second sighting)
    real_kept = expanded_mod.merge_expanded_prefix
    monkeypatch.setattr(expanded_mod, "merge_expanded_prefix", lambda *a: kept.append(1) or real_kept(*a))
    hoisted = []
    real_long = mla_mod.long_row_attention
    monkeypatch.setattr(mla_mod, "long_row_attention",
                        lambda *a: hoisted.append(a[-1] is not None and len(a) == 9) or real_long(*a))
    if tails == "long":
        monkeypatch.setattr(mla_mod, "prefers_expanded", lambda *a: True)
    path = str(tiny_checkpoints(arch, num_mtp_layers=1) if spec else tiny_checkpoints(arch))
    prefix = random_prompts([150], vocab_size=500, seed=3)[0]
    lengths = [3, 7, 11, 5] if tails == "short" else [20, 33, 24, 40]
    prompts = [prefix + tail for tail in random_prompts(lengths, vocab_size=500, seed=4)]
    prompts.append(random_prompts([160], vocab_size=500, seed=5)[0])  # another request's own prefix: no member
    llm = LLM(path, dtype="float32", block_size=BLOCK, speculative_config=spec)
    llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)  # caches the prefix's blocks
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                            use_tqdm=False)]
    assert merges, "no step attended a shared prefix"
    if arch == "deepseek_v3" and tails == "short":
        assert kept, "no step attended the prefix's kept expansion"
    merges.clear()
    if tails == "long":
        assert any(hoisted), "no prompt chunk reused the shared prefix's expansion"
    alone = LLM(path, dtype="float32", block_size=BLOCK, enable_prefix_caching=False)  # no spec: the oracle
    for p, got in zip(prompts, batched, strict=True):
        want = alone.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
    assert not merges  # one request a step: no cascade


def test_a_shared_expanded_prefix_tips_long_rows_to_the_expanded_form():
    """The bundled model's shapes (4 heads, nope 32, rope 64, v 64, kv_lora 512): a 25-token chunk over 1,000 keys
    is cheaper absorbed alone, but expanded once 32 rows share a 700-key prefix expanded once for all of them (each
    row is charged 1/32 of that expansion); with 2 rows sharing it the absorbed form still wins."""
    from tandem.attention.mla import MLAUpProjection, prefers_expanded

    up = MLAUpProjection(torch.zeros(4, 32, 512), torch.zeros(4, 64, 512))
    assert not prefers_expanded(25, 1000, up, 64)
    assert prefers_expanded(25, 1000, up, 64, num_shared=700, num_sharing=32)
    assert not prefers_expanded(25, 1000, up, 64, num_shared=700, num_sharing=2)
