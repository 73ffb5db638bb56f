"""The fused decoder layer (tandem/native/decoder_layer.cpp, tandem/models/fused_decoder_layer.py): a Llama-family
step of short rows (decodes, verification rows) through one native call a layer gives the module path's tokens and
logprobs bit for bit, in float32 and bfloat16, at batch 1 and in batches, with biases, with speculative
verification rows, with Qwen3's per-head q/k norms, in an EAGLE-3 head's layer (its drafts too); steps it does not
serve (a shared prefix) take the module path."""

from __future__ import annotations

import pytest
import torch
from eagle3_checkpoint import build_eagle3_head
from engine_utils import random_prompts, record_steps
from hf_oracle import hf_greedy

from tandem import LLM, SamplingParams, native
from tandem.models import fused_decoder_layer

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every fused call this test makes (so a test cannot pass by never taking the path), negated for
    calls with their own qkv input (an EAGLE-3 head's layer)."""
    calls: list[int] = []
    real = native.gqa_decoder_layer

    def counted(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(hidden.shape[0] if args[-1] is None else -hidden.shape[0])  # negative: an EAGLE-3 head's layer
        return real(hidden, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "gqa_decoder_layer", counted)
    return calls


def _run(llm: LLM, prompts: list[list[int]], fused: bool, max_tokens: int = 8) -> list[tuple]:
    fused_decoder_layer.enabled = fused
    try:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        fused_decoder_layer.enabled = True
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", [[13], [5, 21, 9, 30]], ids=["batch1", "batch4"])
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True}], ids=["plain", "biases"])
def test_fused_layers_give_the_module_paths_bits(tiny_checkpoints, fused_calls, dtype, lengths, overrides):
    path = tiny_checkpoints("llama", overrides={"num_hidden_layers": 3, **overrides})
    llm = LLM(str(path), dtype=dtype, enable_prefix_caching=False)
    prompts = random_prompts(lengths, vocab_size=500, seed=len(lengths))
    reference = _run(llm, prompts, fused=False)
    assert not fused_calls, "the module path ran with the fused layers off"
    got = _run(llm, prompts, fused=True)
    assert got == reference, "fused layers changed tokens or logprobs"
    # every decode step (7 after the prompts' first tokens) ran its 3 layers fused (short prompts may too)
    assert fused_calls.count(len(lengths)) >= 3 * 7


def test_llama_with_attention_and_mlp_biases_matches_hf(tiny_checkpoints, fused_calls):
    # Llama's attention_bias biases q, k, v and o (o's was refused as an unexpected tensor before the fused layer)
    path = tiny_checkpoints("llama", overrides={"attention_bias": True, "mlp_bias": True})
    prompts = random_prompts([6, 17], vocab_size=500, seed=2)
    got = _run(LLM(str(path), dtype="float32", enable_prefix_caching=False), prompts, fused=True)
    assert [t for t, _ in got] == hf_greedy(path, prompts, 8)
    assert fused_calls


def test_fused_verification_rows_stay_lossless(tiny_checkpoints, fused_calls):
    # n-gram drafts on repetitive prompts: verification rows of up to K + 1 = 4 queries per request
    path = tiny_checkpoints("llama", overrides={"num_hidden_layers": 3})
    prompts = [[7, 8, 9, 10] * 6, [40, 41, 42] * 7 + [40]]
    plain = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    reference = _run(plain, prompts, fused=False, max_tokens=16)
    spec = LLM(str(path), dtype="float32", enable_prefix_caching=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    got = _run(spec, prompts, fused=True, max_tokens=16)
    assert [t for t, _ in got] == [t for t, _ in reference], "speculative greedy with fused layers != no-spec greedy"
    # the prompt step is 46 rows; a verification step 3-8 (1 + K of up to 3 drafts per request), a plain decode 2
    assert any(len(prompts) < n <= len(prompts) * 4 for n in fused_calls), "a verification step ran fused"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_head_norms_give_the_module_paths_bits(tiny_checkpoints, fused_calls, dtype):
    # Qwen3: q and k RMS-normed per head before the rotation; head_dim 32 != hidden / heads (q_proj not square)
    qwen3 = LLM(str(tiny_checkpoints("qwen3")), dtype=dtype, enable_prefix_caching=False)
    prompts = random_prompts([11, 19], vocab_size=500, seed=3)
    reference = _run(qwen3, prompts, fused=False)
    assert _run(qwen3, prompts, fused=True) == reference
    assert fused_calls.count(len(prompts)) >= 2 * 7


def test_steps_the_layer_does_not_serve_take_the_module_path(tiny_checkpoints, fused_calls):
    # two requests behind one cached prefix decode with a shared prefix (attended once for both): module path
    llama = LLM(str(tiny_checkpoints("llama")), dtype="float32", enable_prefix_caching=True)
    prefix = random_prompts([48], vocab_size=500, seed=4)[0]
    shared = [prefix + [5, 6], prefix + [9]]
    _run(llama, [prefix], fused=False, max_tokens=1)  # caches the prefix's blocks
    assert _run(llama, shared, fused=True) == _run(llama, shared, fused=False)


def test_gqa_decoder_layer_refuses_bad_arguments():
    h = torch.zeros(1, 8)
    cache = torch.zeros(2, 1, 16, 1, 8)
    w = torch.zeros(24, 8)
    base = dict(hidden=h, positions=torch.zeros(1, dtype=torch.int64), norms=[torch.ones(8), torch.ones(8)], eps=1e-6,
                weights=[w, torch.zeros(8, 8), torch.zeros(16, 8), torch.zeros(8, 8)], kinds=[1, 1, 1, 1],
                sizes=[24, 8, 16, 8], biases=[None, None, None, None], cos=torch.ones(4, 4), sin=torch.zeros(4, 4),
                rotary_dim=8, interleaved=False, num_heads=1, num_kv_heads=1, head_dim=8, kv_cache=cache,
                write_slots=torch.zeros(1, dtype=torch.int64), block_table=torch.zeros(1, 1, dtype=torch.int32),
                rows=torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.int32),
                attn_positions=torch.zeros(1, dtype=torch.int64), scale=1.0)
    out = native.gqa_decoder_layer(**base)  # type: ignore[arg-type]
    assert out.shape == (1, 8) and torch.equal(out, h), "zero weights: the layer adds nothing to the stream"
    with pytest.raises(RuntimeError, match="linear kind 7"):
        native.gqa_decoder_layer(**{**base, "kinds": [7, 1, 1, 1]})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="q \\+ 2 kv wide"):
        native.gqa_decoder_layer(**{**base, "sizes": [16, 8, 16, 8]})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="write_slots"):
        native.gqa_decoder_layer(**{**base, "write_slots": torch.zeros(2, dtype=torch.int64)})  # type: ignore[arg-type]
    for slot in (-1, 16):  # the cache holds slots 0..15: a slot outside it is refused before any write
        with pytest.raises(RuntimeError, match=f"write slot {slot} is outside"):
            native.gqa_decoder_layer(**{**base, "write_slots": torch.tensor([slot])})  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_eagle3_head_layer_gives_the_module_paths_drafts(tiny_checkpoints, fused_calls, tmp_path, monkeypatch,
                                                               dtype):
    # the head's layer reads cat(norm(embeds), norm(hidden)) [T, 2H] into qkv: the fused call takes it as attn_input
    target = tiny_checkpoints("llama", overrides={"num_hidden_layers": 4})
    head = build_eagle3_head(target, tmp_path / "head")
    llm = LLM(str(target), dtype=dtype, enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    steps = record_steps(llm, monkeypatch)
    hooked: list[int] = []  # a forward hook on the head's layer runs once a call on either path
    llm.engine.executor.runner.proposer.mtp.midlayer.register_forward_hook(lambda m, a, out: hooked.append(1))
    prompts = random_prompts([11, 4, 23], vocab_size=500, seed=5)
    reference = _run(llm, prompts, fused=False, max_tokens=12)
    reference_drafts, reference_hooks = [out.draft_token_ids for _, out in steps], len(hooked)
    assert not fused_calls
    steps.clear()
    hooked.clear()
    got = _run(llm, prompts, fused=True, max_tokens=12)
    assert got == reference, "fused layers changed tokens or logprobs"
    assert [out.draft_token_ids for _, out in steps] == reference_drafts, "the fused head drafted other tokens"
    assert len(hooked) == reference_hooks
    # the head's draft decodes (3 rows) and its step 0 over the verified rows ran fused
    assert fused_calls.count(-len(prompts)) >= 2 and any(n < -len(prompts) for n in fused_calls)
