"""`calculate_kv_scales` (issue 46): per-layer fp8 KV scales from the first batch's K/V. Outcomes: fp8 with
calculated scales is blind to the K/V magnitude (a checkpoint whose K and V are 2^-10 smaller, Q and O 2^10
larger, computes the same function and gives the same fp8 tokens, while scale 1.0 flushes its K/V to zero), the
option needs an fp8 cache, and every layout computes one rank's scales (tests/test_kv_cache_dtype_layouts.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from engine_utils import random_prompts
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.config import ConfigError

PROMPTS = random_prompts([5, 12, 23, 40], vocab_size=500, seed=3)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHIFT = 2.0 ** 10  # a power of two: the rescaled checkpoint is the same function to the bit in float32


def _rescaled(src: Path, dst: Path) -> Path:
    """q_proj and o_proj x 2^10, k_proj and v_proj / 2^10: scores q.k and the output o(p.v) are unchanged, the
    stored K/V are 1024x smaller (most below e4m3's smallest subnormal, 2^-9, at scale 1)."""
    shutil.copytree(src, dst)
    factors = {"q_proj": SHIFT, "o_proj": SHIFT, "k_proj": 1 / SHIFT, "v_proj": 1 / SHIFT}
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            for proj, factor in factors.items():
                if f".{proj}." in name:
                    tensors[name] = t * factor
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def _tokens(path: Path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_calculated_scales_make_fp8_blind_to_the_kv_magnitude(tiny_checkpoints, tmp_path):
    original = tiny_checkpoints("llama")
    small_kv = _rescaled(original, tmp_path / "small-kv")
    assert _tokens(small_kv) == _tokens(original), "the rescaled checkpoint should compute the same function"
    calculated = _tokens(original, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert _tokens(small_kv, kv_cache_dtype="fp8", calculate_kv_scales=True) == calculated
    assert _tokens(small_kv, kv_cache_dtype="fp8") != calculated, "at scale 1.0 the tiny K/V should be lost"


@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
def test_calculate_kv_scales_needs_an_fp8_cache(tiny_checkpoints, kv):
    with pytest.raises(ConfigError, match=r"calculate_kv_scales \(--calculate-kv-scales\)=True is not allowed: only "
                                          rf"with an fp8 kv_cache_dtype .*not '{kv}'"):
        LLM(str(tiny_checkpoints("llama")), kv_cache_dtype=kv, calculate_kv_scales=True)


def test_scales_stay_fixed_after_the_first_batch(tiny_checkpoints):
    """A second, larger-valued batch saturates instead of moving the scales: later requests never re-quantize
    what earlier ones stored."""
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True)
    try:
        from tandem.worker.kv_cache import attention_modules

        runner = llm.engine.executor.runner
        layers = attention_modules(runner.model)
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)
        first = [(m.k_scale, m.v_scale) for m in layers]
        assert all(k != 1.0 and v != 1.0 for k, v in first)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        assert [(m.k_scale, m.v_scale) for m in layers] == first
    finally:
        llm.shutdown()
    assert torch.isfinite(torch.tensor(first)).all()
