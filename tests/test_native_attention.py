"""The native CPU paged-attention kernel (tandem/native): on seeded random paged layouts (GQA with its own
values, MLA-style latents whose values are the keys' first channels; decodes, verification rows, rows behind a
shared prefix, PCP-like rows whose positions skip, rows long enough to be split into chunks) its output and LSE
equal a float64 reference in float32 and to bf16's precision in bfloat16, tokens in no row stay zero, a row out
of range is refused, and engines give the same greedy tokens with it and with the PyTorch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import random_prompts

from tandem import LLM, SamplingParams, native

BLOCK = 16


pytestmark = pytest.mark.usefixtures("native_kernels")


def _layout(rng: np.random.Generator, num_rows: int, max_keys: int, pcp_like: bool, max_queries: int = 16):
    """-> (rows [R, 5] int32, positions [T] int64, block table [R, max_blocks] int32, number of slots)."""
    rows, positions, t = [], [], 0
    seq_lens = rng.integers(1, max_keys + 1, size=num_rows)
    width = -(-int(seq_lens.max()) // BLOCK)
    pool = num_rows * width + 4
    table = rng.permutation(pool)[: num_rows * width].reshape(num_rows, width).astype(np.int32)
    for i, s in enumerate(seq_lens.tolist()):
        n = int(rng.integers(1, min(max_queries, s) + 1))
        key_start = BLOCK * int(rng.integers(0, (s - n) // BLOCK + 1)) if rng.random() < 0.3 else 0
        pos = np.arange(s - n, s)
        if pcp_like and n > 2:  # a rank's piece of a row: some positions only, the last one not always included
            pos = np.sort(rng.choice(np.arange(max(key_start, s - 2 * n), s), size=n, replace=False))
        rows.append([i, t, n, s, key_start])
        positions.append(pos)
        t += n
    positions.append(np.zeros(3, dtype=np.int64))  # graph padding: tokens in no row
    return (torch.tensor(rows, dtype=torch.int32), torch.from_numpy(np.concatenate(positions)).long(),
            torch.from_numpy(table), pool * BLOCK)


def _reference(q, k, v, table, rows, positions, scale):
    """float64: query token t of a row sees keys at positions [key_start, min(positions[t] + 1, seq_len))."""
    tq, hq, _ = q.shape
    r = hq // k.shape[1]
    out = torch.zeros(tq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float64)
    for table_row, t0, n, s, ks in rows.tolist():
        key_pos = torch.arange(ks, s)
        slots = table[table_row][key_pos // BLOCK].long() * BLOCK + key_pos % BLOCK
        keys = k[slots].double().repeat_interleave(r, dim=1)  # [S, Hq, Dk]
        values = v[slots].double().repeat_interleave(r, dim=1)
        for t in range(t0, t0 + n):
            scores = torch.einsum("hd,shd->hs", q[t].double(), keys) * scale
            scores[:, key_pos > positions[t]] = float("-inf")
            lse[t] = scores.logsumexp(-1)
            out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
    return out, lse


# bf16 queries over a bf16 cache: the widening path (0), avx512_bf16's dot products (1) where the CPU has them, and
# those with AMX tiles for rows of 33 queries or more (2) where it has AMX
BF16_PATHS = [0] + ([1] if torch.cpu._is_avx512_bf16_supported() else []) \
    + ([2] if torch.cpu._is_amx_tile_supported() else [])
PATHS = [(torch.float32, -1)] + [(torch.bfloat16, isa) for isa in BF16_PATHS]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", ["gqa", "mha", "mla", "mla_wide", "mla_odd", "gqa_wide", "gqa_tails"])
@pytest.mark.parametrize(("dtype", "isa"), PATHS)
def test_kernel_equals_float64_reference(seed, shape, dtype, isa):
    """Wide keys (over the kernel's kWideKey, 128) take the keys-outer loops, four queries x four keys at a time on
    avx512: DeepSeek's 576-wide latents, odd widths and head counts (tails of every loop), a wide GQA head; the bf16
    dot products' masked tails (channels not a multiple of 32, five queries a KV head: a block of four and one)."""
    rng = np.random.default_rng(seed)
    hq, hkv, dk, dv = {"gqa": (6, 2, 32, 32), "mha": (3, 3, 16, 24), "mla": (8, 1, 72, 64),
                       "mla_wide": (4, 1, 576, 512), "mla_odd": (5, 1, 200, 136), "gqa_wide": (6, 2, 160, 144),
                       "gqa_tails": (10, 2, 40, 56)}[shape]
    rows, positions, table, slots = _layout(rng, int(rng.integers(1, 9)), 300, pcp_like=seed % 2 == 1)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, dk, generator=g).to(dtype)
    v = k[..., :dv] if shape == "mla" else torch.randn(slots, hkv, dv, generator=g).to(dtype)
    q = torch.randn(positions.shape[0], hq, dk, generator=g).to(dtype)
    out = torch.full((q.shape[0], hq, dv), 7.0, dtype=dtype)  # every row token is written; padding keeps 7
    lse = torch.full((q.shape[0], hq), 7.0)
    scale = dk**-0.5
    native.paged_attention(q, k, v, table, rows, positions, BLOCK, scale, out, lse, isa)
    want, want_lse = _reference(q, k, v, table, rows, positions, scale)
    real = int((rows[:, 1] + rows[:, 2]).max())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:real].double(), want[:real], rtol=tol, atol=tol)
    torch.testing.assert_close(lse[:real].double(), want_lse[:real], rtol=1e-5, atol=1e-5)
    assert (out[real:] == 7).all() and (lse[real:] == 7).all(), "tokens in no row are not written"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["gqa", "smollm2", "tails", "mla_wide"])
@pytest.mark.parametrize(("dtype", "isa"), PATHS)
def test_prompt_rows_equal_float64_reference(seed, shape, dtype, isa):
    """Rows of up to 100 queries (prompt rows, chunked prefill; AMX tiles from 33 queries where the CPU has them),
    some behind a shared prefix or with skipping positions, split into key chunks or not."""
    rng = np.random.default_rng(100 + seed)
    hq, hkv, dk, dv = {"gqa": (6, 2, 32, 32), "smollm2": (9, 3, 64, 64), "tails": (10, 2, 40, 56),
                       "mla_wide": (4, 1, 576, 512)}[shape]
    rows, positions, table, slots = _layout(rng, int(rng.integers(1, 5)), 300, pcp_like=seed % 2 == 1,
                                            max_queries=100)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, dk, generator=g).to(dtype)
    v = torch.randn(slots, hkv, dv, generator=g).to(dtype)
    q = torch.randn(positions.shape[0], hq, dk, generator=g).to(dtype)
    out = torch.full((q.shape[0], hq, dv), 7.0, dtype=dtype)
    lse = torch.full((q.shape[0], hq), 7.0)
    native.paged_attention(q, k, v, table, rows, positions, BLOCK, dk**-0.5, out, lse, isa)
    want, want_lse = _reference(q, k, v, table, rows, positions, dk**-0.5)
    real = int((rows[:, 1] + rows[:, 2]).max())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:real].double(), want[:real], rtol=tol, atol=tol)
    torch.testing.assert_close(lse[:real].double(), want_lse[:real], rtol=1e-5, atol=1e-5)
    assert (out[real:] == 7).all() and (lse[real:] == 7).all(), "tokens in no row are not written"


@pytest.mark.parametrize(("dtype", "isa"), PATHS)
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_a_query_gives_the_same_bits_in_a_decode_row_and_in_a_verification_row(dtype, isa, shape):
    """Greedy speculation equals no-spec only if a verification row's queries give the bits their decodes would: the
    last query of rows of 1-6 and 32 queries against that query alone. GQA: 9 query heads over 3 KV heads of 64;
    MLA: 4 heads over one 576-wide latent whose first 512 channels are the values (a view), where the queries of a
    row are weighted four at a time."""
    g = torch.Generator().manual_seed(3)
    s = 150
    if shape == "gqa":
        hq, dk, dv = 9, 64, 64
        k, v = torch.randn(s + 16, 3, dk, generator=g).to(dtype), torch.randn(s + 16, 3, dv, generator=g).to(dtype)
    else:
        hq, dk, dv = 4, 576, 512
        k = torch.randn(s + 16, 1, dk, generator=g).to(dtype)
        v = k[..., :dv]
    table = torch.arange((s + 15) // BLOCK)[None].int()
    q = torch.randn(32, hq, dk, generator=g).to(dtype)
    outs = []
    for n in (*range(1, 7), 32):
        rows = torch.tensor([[0, 0, n, s, 0]], dtype=torch.int32)
        out, lse = torch.zeros(n, hq, dv, dtype=dtype), torch.zeros(n, hq)
        native.paged_attention(q[32 - n:], k, v, table, rows, torch.arange(s - n, s), BLOCK, dk**-0.5, out, lse,
                               isa)
        outs.append((out[-1], lse[-1]))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_the_default_path_is_the_best_this_cpu_has():
    """isa -1 (what the engine calls) gives the bits of the fastest path here: AMX tiles for prompt rows where the
    CPU has AMX, else the bf16 dot products where it has avx512_bf16, else the widening path."""
    rng = np.random.default_rng(5)
    rows, positions, table, slots = _layout(rng, 4, 200, pcp_like=False, max_queries=60)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(slots, 3, 64, generator=g).bfloat16(), torch.randn(slots, 3, 64, generator=g).bfloat16()
    q = torch.randn(positions.shape[0], 9, 64, generator=g).bfloat16()
    outs = {}
    for isa in (-1, BF16_PATHS[-1]):
        out, lse = torch.zeros(q.shape[0], 9, 64, dtype=torch.bfloat16), torch.zeros(q.shape[0], 9)
        native.paged_attention(q, k, v, table, rows, positions, BLOCK, 0.125, out, lse, isa)
        outs[isa] = (out, lse)
    assert torch.equal(outs[-1][0], outs[BF16_PATHS[-1]][0]) and torch.equal(outs[-1][1], outs[BF16_PATHS[-1]][1])


def test_an_isa_this_cpu_lacks_is_refused():
    q = torch.randn(1, 2, 32).bfloat16()
    args = (q, q, q, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64), BLOCK, 1.0, torch.empty_like(q), torch.empty(1, 2))
    with pytest.raises(RuntimeError, match="isa is -1"):
        native.paged_attention(*args, isa=3)
    if not torch.cpu._is_avx512_bf16_supported():
        with pytest.raises(RuntimeError, match="no avx512_bf16"):
            native.paged_attention(*args, isa=1)
    elif not native.amx_available():
        with pytest.raises(RuntimeError, match="no AMX-BF16"):
            native.paged_attention(*args, isa=2)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_row_split_into_chunks_merges_exactly(threads):
    """One row of 5,000 keys (MLA-shaped): the kernel splits it into chunks over the threads and merges them by
    LSE; the result is the reference's whatever the split."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        s, n = 5000, 3
        table = torch.randperm(s // BLOCK + 8, generator=g)[None, : -(-s // BLOCK)].int()
        k = torch.randn((s // BLOCK + 8) * BLOCK, 1, 72, generator=g)
        q = torch.randn(n, 8, 72, generator=g)
        rows = torch.tensor([[0, 0, n, s, 0]], dtype=torch.int32)
        positions = torch.arange(s - n, s)
        out, lse = torch.zeros(n, 8, 64), torch.zeros(n, 8)
        native.paged_attention(q, k, k[..., :64], table, rows, positions, BLOCK, 0.1, out, lse)
        want, want_lse = _reference(q, k, k[..., :64], table, rows, positions, 0.1)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_rows_out_of_range_are_refused():
    q, k = torch.zeros(2, 2, 8), torch.zeros(64, 1, 8)
    table = torch.zeros(1, 4, dtype=torch.int32)
    out, lse = torch.zeros(2, 2, 8), torch.zeros(2, 2)
    for bad in ([1, 0, 1, 5, 0], [0, 1, 2, 5, 0], [0, 0, 1, 65, 0], [0, 0, 0, 5, 0]):
        with pytest.raises(RuntimeError, match="row 0 is out of range"):
            native.paged_attention(q, k, k, table, torch.tensor([bad], dtype=torch.int32), torch.zeros(2).long(),
                                   BLOCK, 1.0, out, lse)
    with pytest.raises(RuntimeError, match="int32"):
        native.paged_attention(q, k, k, table.long(), torch.tensor([[0, 0, 1, 5, 0]], dtype=torch.int32),
                               torch.zeros(2).long(), BLOCK, 1.0, out, lse)


@pytest.mark.parametrize("arch,spec", [
    ("llama", None),
    ("llama", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    ("deepseek_v3", {"method": "mtp", "num_speculative_tokens": 3}),
])
def test_engine_tokens_equal_the_pytorch_path(tiny_checkpoints, monkeypatch, arch, spec):
    """Greedy tokens and accepted drafts with the kernel and with the PyTorch path (padded gathers + SDPA, in-place
    views): decodes, verification rows of K + 1 tokens, MTP's draft decodes and, with a budget of 16 tokens a step,
    prompt chunks as short rows."""
    path = str(tiny_checkpoints(arch, num_mtp_layers=1) if arch == "deepseek_v3" else tiny_checkpoints(arch))
    prompts = random_prompts([5, 19, 33, 70], vocab_size=500, seed=23)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens, accepted = {}, {}
    for on in (True, False):
        monkeypatch.setitem(native._state, "ok", on)
        llm = LLM(path, dtype="float32", max_num_batched_tokens=16, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[on] = [o.outputs[0].token_ids for o in outs]
        accepted[on] = [getattr(m, "value", None) for m in llm.get_metrics()
                        if m.name == "tandem:spec_decode_num_accepted_tokens"]
        llm.shutdown()
    assert tokens[True] == tokens[False]
    assert accepted[True] == accepted[False], "the drafts (MTP's draft decodes read their keys natively) agree"


@pytest.mark.parametrize("arch", ["llama", "glm4_moe", "deepseek_v3"])
def test_prompt_rows_through_the_kernel_give_the_same_tokens(tiny_checkpoints, monkeypatch, arch):
    """Prompt rows of 17..NATIVE_PROMPT_TOKENS queries run whole through the kernel in a GQA model (MLA keeps its
    long-row path); longer ones keep per-row SDPA. Same greedy tokens as the PyTorch path, one budget taking every
    prompt at once."""
    from tandem.attention import metadata

    path = str(tiny_checkpoints(arch))
    prompts = random_prompts([5, 20, 64, metadata.NATIVE_PROMPT_TOKENS, metadata.NATIVE_PROMPT_TOKENS + 1, 300],
                             vocab_size=500, seed=29)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    built = []
    real = metadata.build_attention_metadata

    def spy(*args, **kwargs):
        meta = real(*args, **kwargs)
        built.append(meta)
        return meta

    tokens = {}
    for on in (True, False):
        monkeypatch.setitem(native._state, "ok", on)
        monkeypatch.setattr(metadata, "build_attention_metadata", spy)
        import tandem.worker.input_batch as input_batch
        monkeypatch.setattr(input_batch, "build_attention_metadata", spy, raising=False)
        built.clear()
        llm = LLM(path, dtype="float32", max_num_batched_tokens=1024)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[on] = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
        picked = [int(n) for m in built if m.native_long_rows is not None for n in m.native_long_rows[:, 2]]
        if on:
            assert sorted(picked) == [20, 64, metadata.NATIVE_PROMPT_TOKENS], picked
            assert all(lr.native == (lr.num_queries <= metadata.NATIVE_PROMPT_TOKENS)
                       for m in built for lr in m.long_rows)
        else:
            assert not picked
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("arch, served", [("llama", True), ("glm4_moe", True), ("deepseek_v3", False)])
def test_bf16_models_use_the_kernel_unless_they_have_mla(tiny_checkpoints, arch, served):
    """bf16 GQA models run the kernel (their tokens stay within test_bf16_parity's tie rule); bf16 MLA keeps the
    PyTorch path (tandem/native/__init__.py says why); float32 runs it whatever the attention."""
    llm = LLM(str(tiny_checkpoints(arch)), dtype="bfloat16")
    with native.serving(llm.engine.executor.runner.native):
        assert native.enabled() is served
    llm.shutdown()
    with native.serving(native.Serving(torch.float32, mla=True)):
        assert native.enabled()


def test_engines_in_one_process_keep_their_own_kernel_choice(tiny_checkpoints):
    """Which kernels serve a model travels with its engine, not the process: a bf16 MLA engine (PyTorch paths) gives
    the same tokens before and after a float32 engine (native kernels) starts beside it and runs; an engine whose
    compilation_config turns the kernels off keeps them off beside one that uses them."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 19, 33], vocab_size=500, seed=2)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    mla_bf16 = LLM(str(tiny_checkpoints("deepseek_v3")), dtype="bfloat16", enable_prefix_caching=False)
    alone = tokens(mla_bf16)
    gqa_f32 = LLM(str(tiny_checkpoints("llama")), dtype="float32")
    tokens(gqa_f32)
    assert tokens(mla_bf16) == alone
    off = LLM(str(tiny_checkpoints("llama")), dtype="float32", compilation_config={"native_kernels": False})
    for llm, served in ((off, False), (gqa_f32, True)):
        with native.serving(llm.engine.executor.runner.native):
            assert native.enabled() is served
    for llm in (mla_bf16, gqa_f32, off):
        llm.shutdown()


_BUILDER = """
import fcntl, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
held = open(folder / "builder.flock", "a")
fcntl.flock(held, fcntl.LOCK_EX)
(folder / "lock").touch()  # torch's builder's mark
print("building", flush=True)
time.sleep(float(sys.argv[2]))
(folder / "lock").unlink()  # a build that finishes removes its mark
"""


def _builder(folder, seconds: float):
    """A process that builds in `folder` the way tandem's builder does, for `seconds`; returned once it holds the
    builder lock."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(folder), str(seconds)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"building\n"
    return proc


def test_a_build_lock_left_by_a_killed_build_is_removed_at_once(tmp_path, capsys):
    """torch's extension builder waits with no time limit for another build's `lock` file to go; a builder killed
    midway (SIGKILL) leaves it, and every later engine hung. Its flock dies with it: the next builder removes the
    lock at once, without a wait."""
    import time

    from tandem.native.build_lock import building

    proc = _builder(tmp_path, 60)
    proc.kill()
    proc.wait()
    assert (tmp_path / "lock").exists()
    start = time.monotonic()
    with building(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 5
    assert "waiting" not in capsys.readouterr().err


def test_a_live_build_is_waited_for_and_its_lock_left_alone(tmp_path, capsys):
    """A build under way holds the builder lock however old its `lock` file is: a second builder says it waits
    (one line), and goes on once the first has finished."""
    import os
    import time

    from tandem.native.build_lock import building

    proc = _builder(tmp_path, 1.5)
    old = time.time() - 3600  # an hour-old mark of a live build is still a live build
    os.utime(tmp_path / "lock", (old, old))
    start = time.monotonic()
    with building(tmp_path, poll_s=0.05):
        assert proc.wait(timeout=5) == 0 and not (tmp_path / "lock").exists()
    assert time.monotonic() - start > 1.0
    assert capsys.readouterr().err.count("waiting for another process's build") == 1


def test_a_compiler_a_killed_build_left_running_is_waited_for(tmp_path):
    """ninja runs in the build folder and outlives a SIGKILLed builder: its lock is removed only once the processes
    working in the folder have finished (they would otherwise race the next build over the same object files)."""
    import subprocess
    import time

    from tandem.native.build_lock import building, processes_in

    (tmp_path / "lock").touch()
    orphan = subprocess.Popen(["sleep", "1.5"], cwd=tmp_path)
    assert processes_in(tmp_path) == [orphan.pid]
    start = time.monotonic()
    with building(tmp_path, poll_s=0.05):
        assert not (tmp_path / "lock").exists()
        orphan.wait(timeout=1)  # it ended before the lock went (and is reaped here)
    assert time.monotonic() - start > 1.0


@pytest.mark.parametrize(("dtype", "isa"), PATHS)
def test_a_long_prompt_row_gives_the_same_bits_on_any_number_of_threads(dtype, isa):
    """One prompt row of 300 queries behind 700 cached keys: the reference's result, and the same bits on 1 and 2
    threads (the row is split into more tasks with more threads: key chunks merged by LSE, or on AMX tiles query
    blocks)."""
    g = torch.Generator().manual_seed(4)
    s, n = 1000, 300
    table = torch.randperm(s // BLOCK + 8, generator=g)[None, : -(-s // BLOCK)].int()
    k = torch.randn((s // BLOCK + 8) * BLOCK, 3, 64, generator=g).to(dtype)
    v = torch.randn((s // BLOCK + 8) * BLOCK, 3, 64, generator=g).to(dtype)
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    rows = torch.tensor([[0, 0, n, s, 0]], dtype=torch.int32)
    positions = torch.arange(s - n, s)
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, lse = torch.zeros(n, 9, 64, dtype=dtype), torch.zeros(n, 9)
            native.paged_attention(q, k, v, table, rows, positions, BLOCK, 0.125, out, lse, isa)
            outs.append((out, lse))
    finally:
        torch.set_num_threads(before)
    want, want_lse = _reference(q, k, v, table, rows, positions, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0][0].double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(outs[0][1].double(), want_lse, rtol=1e-5, atol=1e-5)
    if isa == 2:  # key chunks merge in another order on another split; a query block's softmax is whole
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
