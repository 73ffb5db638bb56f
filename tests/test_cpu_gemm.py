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
    PACK_MIN_ELEMENTS,
    fp32_on_panels,
    linear,
    prepack,
    prepack_linears,
)
from tandem.layers.embedding import ParallelLMHead

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("shape", [(4096, 256), (1024, 1536)])  # one row: F.linear, then the packed GEMM
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(shape, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    b = torch.randn(shape[0], generator=g) if bias else None
    x = torch.randn(rows, shape[1], generator=g)
    assert (w.numel() >= ANY_ROWS_ELEMENTS) == (shape == (1024, 1536)), "the two shapes straddle the one-row rule"
    packed = prepack(w)
    assert packed is not None, f"a [{shape[0]}, {shape[1]}] float32 weight is packed"
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear(x, w, b, packed)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-4, f"{rows} rows x {shape}: packed GEMM is {err:.2e} from float64"


def test_small_and_unsupported_weights_stay_unpacked():
    assert prepack(torch.randn(256, 256)) is None, f"under PACK_MIN_ELEMENTS ({PACK_MIN_ELEMENTS})"
    assert prepack(torch.randn(2048, 512, dtype=torch.float64)) is None, "float64 has no oneDNN path"
    assert linear(torch.ones(2, 3), torch.ones(4, 3), None, None).tolist() == [[3.0] * 4] * 2


def _wide_llama(tiny_checkpoints):
    # gate_up [8192, 128] and down [128, 4096]: at or over PACK_MIN_ELEMENTS; attention projections stay under it
    return tiny_checkpoints("llama", overrides={"hidden_size": 128, "intermediate_size": 4096})


def test_engine_with_packed_weights_matches_hf(tiny_checkpoints):
    path = _wide_llama(tiny_checkpoints)
    prompts = random_prompts([3, 17, 40], vocab_size=500, seed=5)
    llm = LLM(str(path), dtype="float32")
    model = llm.engine.executor.runner.model
    packed = [name for name, m in model.named_modules() if getattr(m, "packed_weight", None) is not None]
    # oneDNN's layout for the weights past PACK_MIN_ELEMENTS (the MLP's here); every weight on the panels where
    # float32 runs there (an avx2 CPU without avx512)
    if fp32_on_panels():
        assert len(packed) == len([m for m in model.modules() if hasattr(m, "packed_weight")]), f"packed: {packed}"
    else:
        assert packed and all("mlp" in name for name in packed), f"packed: {packed}"
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
