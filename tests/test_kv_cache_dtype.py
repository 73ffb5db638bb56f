"""kv_cache_dtype (auto, bfloat16, fp8 = fp8_e4m3, fp8_e5m2) on one rank: stores saturate (never inf / nan), the
cache tensors take the dtype and the same byte budget holds 2x / 4x the tokens, unknown values and a too-small pool
are refused naming the dtype, checkpoint k_scale / v_scale are loaded and fold exactly, the native kernel reads a
narrow cache as the PyTorch path does, and every backend and drafter runs on a narrow cache."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from engine_utils import random_prompts
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams, native
from tandem.attention.kv_dtype import store_rows, to_cache
from tandem.attention.layer import Attention, MLAAttention
from tandem.config import ConfigError
from tandem.entrypoints.engine_args import EngineArgs

STORAGE = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
           "fp8_e5m2": torch.float8_e5m2}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
PROMPTS = random_prompts([5, 19, 40], vocab_size=500, seed=3)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_store_saturates_at_the_formats_largest_value(dtype):
    big, f32 = torch.finfo(dtype).max, torch.finfo(torch.float32).max
    x = torch.tensor([0.0, 1.5, -3.0, min(big * 1.01, f32), -min(big * 1.5, f32), f32, -f32])
    stored = to_cache(x, dtype).float()
    assert torch.isfinite(stored).all(), f"{dtype}: {stored}"
    assert stored[3:].abs().eq(big).all(), f"{dtype}: values past the range must saturate at {big}, got {stored}"
    assert stored[:3].tolist() == [0.0, 1.5, -3.0]
    # a scale divides first: 2 * max / 2 lands on the largest value exactly, 4 * max / 2 saturates
    assert to_cache(torch.tensor([2 * min(big, 1e30), 4 * min(big, 1e30)]), dtype, 2.0).float().abs().max() <= big


def test_auto_store_is_the_identity():
    x = torch.randn(4, 8)
    assert to_cache(x, torch.float32) is x


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
def test_store_rows_writes_the_slots(dtype):
    cache = torch.zeros(10, 2, 4, dtype=dtype)
    rows = to_cache(torch.arange(24, dtype=torch.float32).view(3, 2, 4) / 8, dtype)
    store_rows(cache, torch.tensor([7, 0, 3]), rows)
    assert torch.equal(cache[[7, 0, 3]].float(), rows.float())
    assert cache[[1, 2, 4, 5, 6, 8, 9]].float().abs().sum() == 0


def test_unknown_kv_cache_dtype_names_the_flag_and_the_values(tiny_checkpoints):
    path = str(tiny_checkpoints("llama"))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype \(--kv-cache-dtype\)='fp4'.*auto, bfloat16, fp8, "
                                          r"fp8_e4m3, fp8_e5m2"):
        LLM(path, kv_cache_dtype="fp4")
    p = argparse.ArgumentParser(exit_on_error=False)
    EngineArgs.add_cli_args(p)
    assert p.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(argparse.ArgumentError, match="--kv-cache-dtype.*fp8_e4m3"):
        p.parse_args(["--kv-cache-dtype", "int4"])


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_same_byte_budget_holds_2x_and_4x_the_tokens(tiny_checkpoints, arch):
    """float32 model: bfloat16 holds 2x the blocks of auto, fp8 4x (the tiny caches' blocks divide evenly)."""
    path = str(tiny_checkpoints(arch))
    blocks, dtypes = {}, {}
    for name in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=name, kv_cache_memory_bytes=1 << 22, max_model_len=128)
        try:
            blocks[name] = llm.engine.executor.num_kv_blocks
            runner = llm.engine.executor.runner
            dtypes[name] = {m.kv_cache.dtype for m in runner.model.modules() if isinstance(m, Attention | MLAAttention)}
        finally:
            llm.shutdown()
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8"] == 4 * blocks["auto"], blocks
    assert blocks["fp8_e5m2"] == blocks["fp8"], blocks
    assert dtypes == {"auto": {torch.float32}, "bfloat16": {torch.bfloat16}, "fp8": {torch.float8_e4m3fn},
                      "fp8_e5m2": {torch.float8_e5m2}}


def test_too_small_pool_names_the_dtype(tiny_checkpoints):
    path = str(tiny_checkpoints("llama"))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8': float8_e4m3fn\), fewer than max_model_len"):
        LLM(path, kv_cache_dtype="fp8", num_gpu_blocks_override=2, max_model_len=128)


def _generate(path: str, **kwargs) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, block_size=4, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [[dict(p) for p in o.outputs[0].logprobs] for o in outs]


def _with_scales(src, dst, scales: dict[str, float]):
    """A copy of checkpoint `src` whose every layer carries `<layer>.self_attn.k_scale` / `v_scale` tensors."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    layers = {n.split(".self_attn.")[0] for n in weights if ".self_attn." in n}
    for layer in layers:
        for name, value in scales.items():
            weights[f"{layer}.self_attn.{name}"] = torch.tensor(value)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_checkpoint_scales_load_and_fold_exactly(tiny_checkpoints, tmp_path, arch):
    """Power-of-two scales divide and multiply back exactly, so a bfloat16 cache with k_scale = 4, v_scale = 0.5
    gives the same tokens and log-probs, to the bit, as without scales: the fold (softmax scale * k_scale,
    output * v_scale) is the math the cache's division undoes."""
    src = tiny_checkpoints(arch)
    scaled = _with_scales(src, tmp_path / "scaled", {"k_scale": 4.0, "v_scale": 0.5})
    llm = LLM(str(scaled), dtype="float32", kv_cache_dtype="bfloat16", max_model_len=128)
    try:
        attn = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Attention | MLAAttention)]
        assert attn and all(m.k_scale == 4.0 and m.v_scale == 0.5 for m in attn)
    finally:
        llm.shutdown()
    assert _generate(str(scaled), kv_cache_dtype="bfloat16") == _generate(str(src), kv_cache_dtype="bfloat16")


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_native_kernel_and_pytorch_paths_agree_on_fp8(tiny_checkpoints, monkeypatch, arch, kv):
    """The native kernel dequantizes the fp8 cache chunk by chunk; the PyTorch paths cast gathered keys: same
    tokens, log-probs within float32 rounding."""
    path = str(tiny_checkpoints(arch))
    assert native.enabled(), "the native CPU kernels build on this machine"
    with_native = _generate(path, kv_cache_dtype=kv)
    monkeypatch.setitem(native._state, "ok", False)
    tokens, logprobs = _generate(path, kv_cache_dtype=kv)
    assert with_native[0] == tokens
    for got, want in zip(with_native[1], logprobs, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys() and max(abs(g[t] - w[t]) for t in g) < 1e-4


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_native_kernel_reads_a_narrow_cache(native_kernels, kv):
    """paged_attention over a narrow cache equals the same call over its float32 copy (the kernel's dequant is
    exact: every narrow value is a float32)."""
    gen = torch.Generator().manual_seed(0)
    block, hkv, hq, d = 4, 2, 4, 16
    k32 = to_cache(torch.randn(64, hkv, d, generator=gen) * 3, STORAGE[kv])
    v32 = to_cache(torch.randn(64, hkv, d, generator=gen), STORAGE[kv])
    if STORAGE[kv] in (torch.float8_e4m3fn, torch.float8_e5m2):
        # every finite code (subnormals, both signs, the largest) in the values, at shuffled places
        codes = torch.arange(256, dtype=torch.uint8).repeat(8)[torch.randperm(2048, generator=gen)]
        v32 = codes.view(STORAGE[kv]).view(64, hkv, d)
        v32 = torch.where(v32.float().isfinite(), v32.float(), 0.0).to(STORAGE[kv])
    q = torch.randn(5, hq, d, generator=gen)
    table = torch.randperm(16, generator=gen).view(2, 8).to(torch.int32)
    rows = torch.tensor([[0, 0, 1, 30, 0], [1, 1, 4, 21, 0]], dtype=torch.int32)
    positions = torch.tensor([29, 17, 18, 19, 20])
    outs = []
    for k, v in ((k32, v32), (k32.float(), v32.float())):
        out, lse = torch.zeros(5, hq, d), torch.zeros(5, hq)
        native.paged_attention(q, k, v, table, rows, positions, block, d**-0.5, out, lse)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


BACKENDS = [("llama", "PAGED_SDPA"), ("llama", "CONTIGUOUS_SDPA"), ("llama", "REFERENCE_SDPA"),
            ("deepseek_v3", "PAGED_MLA"), ("deepseek_v3", "CONTIGUOUS_MLA"), ("deepseek_v3", "REFERENCE_MLA")]


@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_every_backend_runs_on_fp8(tiny_checkpoints, arch, backend):
    """Each backend writes and reads an fp8 cache, and agrees with PAGED_* on it (prefix caching and chunked
    prefill included: the prompts share nothing, the budget of 32 tokens chunks the long one)."""
    path = str(tiny_checkpoints(arch))
    paged = "PAGED_SDPA" if arch == "llama" else "PAGED_MLA"
    tokens, _ = _generate(path, kv_cache_dtype="fp8", attention_config={"backend": backend})
    assert tokens == _generate(path, kv_cache_dtype="fp8", attention_config={"backend": paged})[0]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_narrow_cache_equals_rounding_the_kv_in_a_float32_cache(tiny_checkpoints, monkeypatch, arch, kv):
    """The oracle of a narrow cache: a float32 cache holding the same K/V rounded to the narrow dtype and back. Same
    tokens, log-probs within float32 rounding: nothing but the stored values' rounding changes (the difference from
    auto itself is an accuracy question: docs/kv_cache_dtype.md measures it on SmolLM2)."""
    import tandem.attention.layer as layer
    from tandem.models import fused_decoder_layer

    path = str(tiny_checkpoints(arch))
    tokens, logprobs = _generate(path, kv_cache_dtype=kv)

    def rounded(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return to_cache(to_cache(x, STORAGE[kv], scale).to(x.dtype), dtype)

    monkeypatch.setattr(layer, "to_cache", rounded)
    # the fused decoder layer stores K/V itself, not through the attention layer's to_cache: the oracle runs the
    # module path (which the fused layer equals bit for bit: tests/test_fused_decoder_layer.py)
    monkeypatch.setattr(fused_decoder_layer, "enabled", False)
    ref_tokens, ref_logprobs = _generate(path)
    assert tokens == ref_tokens
    for got, want in zip(logprobs, ref_logprobs, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys() and max(abs(g[t] - w[t]) for t in g) < 1e-4


def test_backend_without_the_dtype_is_refused_by_name(monkeypatch):
    """A backend declares the kv_cache_dtype values it reads: asked for another it is refused naming both, and
    automatic selection passes over it (never a silent upcast of the cache)."""
    from tandem.attention import backend as backend_module
    from tandem.attention.backends.paged_sdpa import PagedSDPABackend

    class AutoOnly(PagedSDPABackend):
        name = "AUTO_ONLY_SDPA"
        kv_cache_dtypes = ("auto",)

    backends = {"AUTO_ONLY_SDPA": AutoOnly, **backend_module.registered_backends()}  # first: automatic tries it first
    monkeypatch.setattr(backend_module, "_REGISTRY", backends)
    with pytest.raises(ValueError, match="'AUTO_ONLY_SDPA' cannot read a kv_cache_dtype='fp8' cache: it reads auto"):
        backend_module.select_backend("full_attention", "AUTO_ONLY_SDPA", False, "fp8")
    assert backend_module.select_backend("full_attention", None, False, "auto") is AutoOnly
    assert backend_module.select_backend("full_attention", None, False, "fp8") is PagedSDPABackend
