"""Greedy tokens and final-position logits of tandem equal Hugging Face's, for every architecture,
under default scheduling, a 16-token chunked-prefill budget, and a KV pool small enough to preempt."""

from __future__ import annotations

import pytest
import torch
from engine_utils import metric, random_prompts, tandem_last_logits
from hf_oracle import hf_greedy, hf_last_logits

from tandem import LLM, SamplingParams

ARCHS = ["llama", "qwen3", "glm4_moe", "deepseek_v3", "glm4_moe_lite"]
PROMPT_LENGTHS = [3, 7, 12, 17, 24, 33, 41, 50]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

# regime -> engine arguments; "preempt" leaves room for ~2.5 of the 8 requests at full length
REGIMES = {
    "default": {},
    "chunked16": {"max_num_batched_tokens": 16},
    "preempt": {"max_num_batched_tokens": 64, "block_size": 4, "num_gpu_blocks_override": 40,
                "max_model_len": 128},
}


@pytest.fixture(scope="module", params=ARCHS)
def arch_ckpt(request, tiny_checkpoints):
    overrides = {"q_lora_rank": None} if request.param == "glm4_moe_lite" else None
    path = tiny_checkpoints(request.param, overrides=overrides)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=500, seed=len(request.param))
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_tokens_match_hf(arch_ckpt, regime):
    arch, path, prompts, expected = arch_ckpt
    llm = LLM(str(path), dtype="float32", **REGIMES[regime])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        got = out.outputs[0].token_ids
        assert got == ref, f"{arch}/{regime} prompt {i} (len {len(prompts[i])}): tandem {got} != HF {ref}"
    if regime == "preempt":
        assert metric(llm, "tandem:num_preemptions") > 0, "the small KV pool should have forced preemption"
    assert metric(llm, "tandem:kv_cache_usage_perc") == 0.0


def test_final_position_logits_match_hf(arch_ckpt):
    arch, path, prompts, _ = arch_ckpt
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    for ids in prompts[-3:]:
        ours, ref = tandem_last_logits(llm, ids), hf_last_logits(path, ids)
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-4, f"{arch}: final logits differ from HF by {diff:.2e} (prompt length {len(ids)})"


def test_smollm2_greedy_matches_hf(smollm2):
    llm = LLM(str(smollm2), dtype="float32", max_num_batched_tokens=64)
    tok = llm.engine.tokenizer
    texts = ["The capital of France is", "def add(a, b):\n    return",
             "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
             "Once upon a time, in a small village by the sea,"]
    prompts = [tok.encode(t) for t in texts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    expected = hf_greedy(smollm2, prompts, MAX_TOKENS)
    for text, out, ref in zip(texts, outs, expected, strict=True):
        got = out.outputs[0]
        assert got.token_ids == ref, f"SmolLM2 on {text!r}: {got.text!r} vs HF {tok.decode(ref)!r}"
    probe = LLM(str(smollm2), enable_prefix_caching=False, max_model_len=256)
    ours, ref = tandem_last_logits(probe, prompts[2]), hf_last_logits(smollm2, prompts[2])
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), f"max diff {(ours - ref).abs().max():.2e}"
