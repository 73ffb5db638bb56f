"""MLA cascade attention over a shared prefix expanded once and kept (tandem/attention/expanded_prefix.py): the
kept expansion gives the dense float64 reference's output, is built on a prefix's second sighting, is dropped by a
write into its slots or a change of the kv_b weight, grows and shrinks with the prefix, and stays within its bound.
End to end (greedy tokens of a batch behind a cached prefix, with and without MTP): test_cascade_attention.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tandem import native
from tandem.attention import expanded_prefix
from tandem.attention.backends.paged_mla import PagedMLABackend
from tandem.attention.metadata import AttentionMetadata, SharedPrefix, build_attention_metadata
from tandem.attention.mla import MLAUpProjection

BLOCK = 16
HEADS, NOPE, ROPE, V, LORA = 4, 8, 4, 8, 16
SCALE = 0.3


def _up(seed: int = 0) -> MLAUpProjection:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(HEADS * (NOPE + V), LORA, generator=g) / 4  # kv_b_proj's weight
    w3 = w.view(HEADS, NOPE + V, LORA)
    return MLAUpProjection(w_uk=w3[:, :NOPE], w_uv=w3[:, NOPE:], w_kv_b=w, kept=expanded_prefix.KeptExpansion())


def _table(seq_lens: list[int], shared_blocks: int) -> np.ndarray:
    """Rows sharing their first `shared_blocks` blocks (consecutive ids), then blocks of their own."""
    need = [-(-s // BLOCK) for s in seq_lens]
    table = np.zeros((len(seq_lens), max(need)), dtype=np.int32)
    nxt = shared_blocks
    for i, n in enumerate(need):
        table[i, :shared_blocks] = np.arange(shared_blocks)
        table[i, shared_blocks:n] = np.arange(nxt, nxt + n - shared_blocks)
        nxt += n - shared_blocks
    return table


def _meta(q_lens: list[int], seq_lens: list[int], table: np.ndarray) -> AttentionMetadata:
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens, strict=True)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = table[rows, positions.numpy() // BLOCK].astype(np.int64) * BLOCK + positions.numpy() % BLOCK
    return build_attention_metadata(positions, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                    torch.from_numpy(table), BLOCK, torch.arange(len(rows)), torch.from_numpy(slots))


def _reference(q_nope, q_pe, cache_flat, table, q_lens, seq_lens, up) -> torch.Tensor:
    """Per row, in float64: the row's latents expanded into per-head keys and values, causal over its positions."""
    outs, start = [], 0
    for i, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = np.arange(s)
        lat = cache_flat[torch.from_numpy(table[i, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)].double()
        k_nope = torch.einsum("sl,hdl->shd", lat[:, :LORA], up.w_uk.double())
        v = torch.einsum("sl,hvl->shv", lat[:, :LORA], up.w_uv.double())
        scores = (torch.einsum("qhd,shd->hqs", q_nope[start: start + n].double(), k_nope)
                  + torch.einsum("qhr,sr->hqs", q_pe[start: start + n].double(), lat[:, LORA:])) * SCALE
        q_pos = torch.arange(s - n, s)
        scores = scores.masked_fill(torch.arange(s)[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqs,shv->qhv", scores.softmax(-1), v))
        start += n
    return torch.cat(outs).float()


CASES = [  # (q_lens, seq_lens): the first rows share 20 blocks (320 keys)
    ([1, 1, 1, 1], [330, 341, 352, 400]),  # decodes
    ([4, 4, 4], [336, 390, 329]),  # verification rows of K + 1 = 4
    ([4, 1, 40], [336, 333, 360]),  # a prompt chunk (a long row) beside two short rows
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("reads", ["torch", "native"])
def test_kept_expansion_gives_the_reference_output(monkeypatch, request, case, reads):
    if reads == "native":
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setitem(native._state, "ok", False)
    q_lens, seq_lens = CASES[case]
    table = _table(seq_lens, 20)
    if case == 2:  # the chunk is another request: it shares nothing
        table[2] = np.arange(200, 200 + table.shape[1])
    g = torch.Generator().manual_seed(case)
    kv_cache = torch.randn(260, BLOCK, LORA + ROPE, generator=g)
    t = sum(q_lens)
    q_nope, q_pe = torch.randn(t, HEADS, NOPE, generator=g), torch.randn(t, HEADS, ROPE, generator=g)
    entries = torch.randn(t, LORA + ROPE, generator=g)
    up = _up()
    meta = _meta(q_lens, seq_lens, table)
    assert meta.shared_prefix is not None and meta.shared_prefix.num_keys == 320
    want = _reference(q_nope, q_pe, kv_cache.flatten(0, 1).index_copy(0, meta.write_slots, entries), table, q_lens,
                      seq_lens, up)
    calls = []
    real_merge = expanded_prefix.merge_expanded_prefix
    monkeypatch.setattr(expanded_prefix, "merge_expanded_prefix", lambda *a: calls.append(1) or real_merge(*a))
    first = PagedMLABackend.forward_mla(q_nope, q_pe, entries, kv_cache, meta, SCALE, up)  # absorbed: first sighting
    assert not calls
    second = PagedMLABackend.forward_mla(q_nope, q_pe, entries, kv_cache, meta, SCALE, up)  # the kept expansion
    assert calls == [1]
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-5)


def _shared(num_keys: int, first_slot: int = 0) -> SharedPrefix:
    return SharedPrefix(num_keys, torch.arange(first_slot, first_slot + num_keys), first_slot, None)


def _fresh(cache_flat: torch.Tensor, shared: SharedPrefix, up: MLAUpProjection) -> expanded_prefix.ExpandedPrefix:
    """An expansion built from scratch on a cache of its own (the oracle of the kept ones)."""
    cache, own = cache_flat.clone(), dataclasses.replace(up, kept=expanded_prefix.KeptExpansion())
    assert expanded_prefix.lookup(cache, shared, own, torch.float32) is None
    kept = expanded_prefix.lookup(cache, shared, own, torch.float32)
    assert kept is not None
    return kept


def test_second_sighting_writes_weights_growth_and_bound():
    g = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(64, BLOCK, LORA + ROPE, generator=g)
    flat = kv_cache.flatten(0, 1)
    up = _up()
    prefix = _shared(320)
    assert expanded_prefix.lookup(flat, prefix, up, torch.float32) is None  # seen once: absorbed
    kept = expanded_prefix.lookup(flat, prefix, up, torch.float32)
    assert kept is not None and kept.keys.shape == (HEADS, 320, NOPE + ROPE)
    assert expanded_prefix.lookup(flat, prefix, up, torch.float32) is kept  # kept across steps
    expanded_prefix.note_writes(up, torch.tensor([320, 500, 1000]))  # writes beside the prefix: kept
    assert expanded_prefix.lookup(flat, prefix, up, torch.float32) is kept
    # a shorter prefix (fewer rows share) is a view of the kept one; a longer one expands only its new keys
    shrunk = expanded_prefix.lookup(flat, _shared(256), up, torch.float32)
    assert shrunk is not None and shrunk.keys.data_ptr() == kept.keys.data_ptr()
    grown = expanded_prefix.lookup(flat, _shared(400), up, torch.float32)
    assert grown is not None and grown.num_keys == 400
    oracle = _fresh(flat, _shared(400), up)
    torch.testing.assert_close(grown.keys, oracle.keys, rtol=0, atol=0)
    torch.testing.assert_close(grown.values, oracle.values, rtol=0, atol=0)
    # a write into the prefix's slots (its blocks reused) drops it; the next sightings rebuild it from the new latents
    flat[17] += 1.0
    expanded_prefix.note_writes(up, torch.tensor([900, 17]))
    assert expanded_prefix.lookup(flat, _shared(400), up, torch.float32) is None
    rebuilt = expanded_prefix.lookup(flat, _shared(400), up, torch.float32)
    assert rebuilt is not None
    torch.testing.assert_close(rebuilt.keys, _fresh(flat, _shared(400), up).keys, rtol=0, atol=0)
    assert not torch.equal(rebuilt.keys[:, 17], oracle.keys[:, 17])
    # new kv_b weights (an in-place update bumps the version): expanded again
    assert up.w_kv_b is not None
    up.w_kv_b.mul_(2.0)
    assert expanded_prefix.lookup(flat, _shared(400), up, torch.float32) is None
    again = expanded_prefix.lookup(flat, _shared(400), up, torch.float32)
    assert again is not None
    torch.testing.assert_close(again.values, 2 * rebuilt.values)
    # a prefix at other slots is another prefix: seen once first
    assert expanded_prefix.lookup(flat, _shared(320, first_slot=480), up, torch.float32) is None


def test_a_prefix_past_the_bound_stays_absorbed(monkeypatch):
    kv_cache = torch.randn(64, BLOCK, LORA + ROPE)
    flat = kv_cache.flatten(0, 1)
    per_key = HEADS * 2 * (NOPE + ROPE) * 4
    up = _up()
    monkeypatch.setattr(expanded_prefix, "MAX_BYTES", 320 * per_key - 1)
    for _ in range(3):
        assert expanded_prefix.lookup(flat, _shared(320), up, torch.float32) is None
    monkeypatch.setattr(expanded_prefix, "MAX_BYTES", 320 * per_key)
    expanded_prefix.lookup(flat, _shared(320), up, torch.float32)
    assert expanded_prefix.lookup(flat, _shared(320), up, torch.float32) is not None


def test_the_kept_expansion_lives_with_its_layer_and_its_cache():
    """Each MLA layer holds its own kept expansion (no module-global table keyed by cache ids); binding a new cache to
    the layer starts it afresh."""
    from tandem.attention.layer import MLAAttention

    layer, other = (MLAAttention(HEADS, LORA, NOPE, ROPE, V, SCALE) for _ in range(2))
    layer.kv_cache = torch.randn(64, BLOCK, LORA + ROPE)
    up = dataclasses.replace(_up(), kept=layer.kept_prefix)
    flat = layer.kv_cache.flatten(0, 1)
    expanded_prefix.lookup(flat, _shared(320), up, torch.float32)
    assert expanded_prefix.lookup(flat, _shared(320), up, torch.float32) is layer.kept_prefix.prefix is not None
    assert other.kept_prefix.prefix is None
    layer.kv_cache = torch.randn(64, BLOCK, LORA + ROPE)
    assert layer.kept_prefix.prefix is None and layer.kept_prefix.seen is None


@pytest.mark.parametrize("reads", ["torch", "native"])
def test_a_prompt_chunk_behind_the_kept_prefix_reuses_it(monkeypatch, request, reads):
    """A new request's prompt chunk whose keys start with the prefix the decode rows keep expanded (a prefix-cache hit
    on the shared few-shot prompt) attends through that expansion, and gives the reference output."""
    if reads == "native":
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setitem(native._state, "ok", False)
    import tandem.attention.backends.paged_mla as mla_mod

    q_lens, seq_lens = [1, 1, 40], [333, 341, 380]
    table = _table(seq_lens, 20)  # all three rows behind the 320-key prefix
    g = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(260, BLOCK, LORA + ROPE, generator=g)
    up = _up()
    decodes = _meta(q_lens[:2], seq_lens[:2], table[:2])
    qd = torch.randn(2, HEADS, NOPE, generator=g), torch.randn(2, HEADS, ROPE, generator=g)
    entries = torch.randn(2, LORA + ROPE, generator=g)
    for _ in range(2):  # the decode rows' steps: the prefix is kept expanded from the second
        PagedMLABackend.forward_mla(*qd, entries, kv_cache, decodes, SCALE, up)
    assert expanded_prefix.peek(up, torch.float32) is not None
    shared_args = []
    real_long = mla_mod.long_row_attention
    monkeypatch.setattr(mla_mod, "long_row_attention", lambda *a: shared_args.append(a[-1]) or real_long(*a))
    meta = _meta(q_lens, seq_lens, table)
    t = sum(q_lens)
    q_nope, q_pe = torch.randn(t, HEADS, NOPE, generator=g), torch.randn(t, HEADS, ROPE, generator=g)
    step_entries = torch.randn(t, LORA + ROPE, generator=g)
    want = _reference(q_nope, q_pe, kv_cache.flatten(0, 1).index_copy(0, meta.write_slots, step_entries), table,
                      q_lens, seq_lens, up)
    got = PagedMLABackend.forward_mla(q_nope, q_pe, step_entries, kv_cache, meta, SCALE, up)
    assert len(shared_args) == 1 and shared_args[0] is not None and shared_args[0][0].shape[0] == 320
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
