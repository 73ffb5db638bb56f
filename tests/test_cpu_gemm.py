"""oneDNN-prepacked linear weights (layers/cpu_gemm.py): the packed GEMM equals F.linear at every row count, small
or unsupported weights stay unpacked, and an engine whose MLP weights are big enough to pack gives Hugging Face's
greedy tokens with them packed (eager) and only the LM head packed (compiled mode's rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_utils import random_prompts
from hf_oracle import hf_greedy

from tandem import LLM, SamplingParams
from tandem.layers.cpu_gemm import (
    ANY_ROWS_ELEMENTS,
    DECODE_MIN_ELEMENTS,
    PACK_ANY_MIN_ELEMENTS,
    PREFILL_ROWS,
    linear,
    prepack,
    prepack_linears,
)
from tandem.layers.embedding import ParallelLMHead

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


# one row: F.linear for the first, the packed GEMM for the second; more rows: packed for both
SHAPES = [(ANY_ROWS_ELEMENTS // 512, 256), (1024, 1536)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(shape, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    b = torch.randn(shape[0], generator=g) if bias else None
    x = torch.randn(rows, shape[1], generator=g)
    assert (w.numel() >= ANY_ROWS_ELEMENTS) == (shape == SHAPES[1]), "the two shapes straddle the one-row rule"
    assert w.numel() >= DECODE_MIN_ELEMENTS
    packed = prepack(w)
    assert packed is not None, f"a [{shape[0]}, {shape[1]}] float32 weight is packed"
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear(x, w, b, packed)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-4, f"{rows} rows x {shape}: packed GEMM is {err:.2e} from float64"


def test_small_and_unsupported_weights_stay_unpacked():
    assert prepack(torch.randn(128, 128)) is None, f"under PACK_ANY_MIN_ELEMENTS ({PACK_ANY_MIN_ELEMENTS})"
    assert prepack(torch.randn(2048, 512, dtype=torch.float64)) is None, "float64 has no oneDNN path"
    assert linear(torch.ones(2, 3), torch.ones(4, 3), None, None).tolist() == [[3.0] * 4] * 2


def test_small_weights_run_packed_only_for_prompt_chunks(monkeypatch):
    """A weight under DECODE_MIN_ELEMENTS is packed but runs on F.linear at decode row counts (where F.linear is
    faster), and packed from PREFILL_ROWS rows on; a weight at or over it runs packed from two rows on."""
    import tandem.layers.cpu_gemm as cpu_gemm

    calls: list[int] = []
    real = F.linear
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    small = torch.randn(64, 1024)  # 64K elements: over PACK_ANY_MIN_ELEMENTS, under DECODE_MIN_ELEMENTS
    big = torch.randn(DECODE_MIN_ELEMENTS // 256, 256)
    assert PACK_ANY_MIN_ELEMENTS <= small.numel() < DECODE_MIN_ELEMENTS
    for w in (small, big):
        packed = prepack(w)
        assert packed is not None
        for rows in (1, 2, 32, PREFILL_ROWS):
            calls.clear()
            x = torch.randn(rows, w.shape[1])
            torch.testing.assert_close(linear(x, w, None, packed), real(x, w), rtol=1e-4, atol=1e-4)
            want_f_linear = rows < PREFILL_ROWS and (w is small or rows == 1 and w.numel() < ANY_ROWS_ELEMENTS)
            assert calls == ([rows] if want_f_linear else []), f"{tuple(w.shape)} at {rows} rows"


def _wide_llama(tiny_checkpoints):
    # gate_up [8192, 128] and down [128, 4096]: packed and run packed at every row count
    return tiny_checkpoints("llama", overrides={"hidden_size": 128, "intermediate_size": 4096})


def test_engine_with_packed_weights_matches_hf(tiny_checkpoints):
    path = _wide_llama(tiny_checkpoints)
    prompts = random_prompts([3, 17, 40], vocab_size=500, seed=5)
    llm = LLM(str(path), dtype="float32")
    model = llm.engine.executor.runner.model
    packed = [name for name, m in model.named_modules() if getattr(m, "packed_weight", None) is not None]
    assert any("mlp" in name for name in packed), f"packed: {packed}"
    assert all(m.weight.numel() >= PACK_ANY_MIN_ELEMENTS for m in model.modules()
               if getattr(m, "packed_weight", None) is not None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy(path, prompts, 16), strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i}: packed weights changed the greedy tokens"
    llm.shutdown()


def test_lm_head_only_packs_nothing_else(tiny_checkpoints):
    """Compiled mode's rule: the pieces inductor compiles get its own packing; only the LM head runs eagerly."""
    llm = LLM(str(_wide_llama(tiny_checkpoints)), dtype="float32")
    model = llm.engine.executor.runner.model
    for m in model.modules():
        if hasattr(m, "packed_weight"):
            m.packed_weight = None
    head = model.lm_head
    head.weight.data = torch.randn(4096, 128)  # a head big enough to pack
    assert prepack_linears(model, lm_head_only=True) == 1
    assert [m for m in model.modules() if getattr(m, "packed_weight", None) is not None] == [head]
    assert isinstance(head, ParallelLMHead)
    llm.shutdown()
