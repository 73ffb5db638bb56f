"""bfloat16 on CPU: tandem's greedy tokens equal Hugging Face's bfloat16 greedy tokens on every tiny architecture,
under one documented numerical-tie rule.

Two bfloat16 implementations round differently (fused vs separate ops, absorbed vs expanded MLA), so on random tiny
models whose top logits are near-tied they may part ways, and a rounding can flip a discrete choice (the MoE router's
top-k) and move one implementation far off. The rule: the outputs must be identical up to the first position where
they differ, and there, teacher-forced on the common prefix, tandem's token must be within TIE of the best token
under HF's bfloat16 logits (a tie at bfloat16 resolution: 8 significant bits, ~0.4% a rounding, a few roundings
deep) or under HF's float32 logits (the exact model; HF's bfloat16 run is the one that left it). Past that
position the sequences legitimately differ.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import random_prompts

from tandem import LLM, SamplingParams

ARCHS = ["llama", "qwen3", "glm4_moe", "deepseek_v3", "glm4_moe_lite"]
MAX_TOKENS = 12
TIE = 0.03  # relative to the top logit's magnitude


def _hf(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "attn_implementation": "eager"}
    if "llama" not in str(path) and "qwen3" not in str(path):
        kwargs["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _gap(logits: torch.Tensor, token: int) -> float:
    """How far `token` is below the best token, relative to the logits' scale."""
    return (logits.max() - logits[token]).item() / max(1.0, logits.abs().max().item())


@torch.inference_mode()
def _hf_greedy_and_logits(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [logits[0].float() for logits in out.logits]


@torch.inference_mode()
def _hf_next_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


def _assert_within_ties(label: str, path, prompts: list[list[int]], outs) -> None:
    bf16, fp32 = _hf(path, torch.bfloat16), _hf(path, torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        ref, _ = _hf_greedy_and_logits(bf16, prompt)
        if ours == ref:
            continue
        j = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
        gaps = [_gap(_hf_next_logits(m, prompt + ref[:j]), ours[j]) for m in (bf16, fp32)]
        assert min(gaps) <= TIE, (f"{label}: at output position {j} tandem chose {ours[j]} and HF bfloat16 {ref[j]}; "
                                  f"tandem's token is {gaps[0]:.3f} (HF bfloat16) and {gaps[1]:.3f} (HF float32) "
                                  f"below the best, more than a bfloat16 tie ({TIE})")


def _generate(path, prompts: list[list[int]], **kwargs):
    llm = LLM(str(path), dtype="bfloat16", **kwargs)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_greedy_matches_hf_up_to_numerical_ties(tiny_checkpoints, arch):
    path = tiny_checkpoints(arch)
    prompts = random_prompts([5, 17, 31], vocab_size=500, seed=7)
    _assert_within_ties(arch, path, prompts, _generate(path, prompts))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_decode_batches_match_hf_up_to_numerical_ties(tiny_checkpoints, compiled):
    """Weights big enough to be packed (on a CPU with AMX: into its tile layout) and 8 sequences, so decode steps
    run the batch GEMM (5+ rows: tandem's AMX GEMM where the CPU has AMX, oneDNN's elsewhere), eager and inside
    compiled pieces, where the linears are opaque ops beside inductor's fused elementwise code; the prompts' rows
    of 33 and 300 queries run attention on AMX tiles where the CPU has them."""
    path = tiny_checkpoints("llama", overrides={"hidden_size": 256, "intermediate_size": 512})
    prompts = random_prompts([5, 9, 12, 17, 20, 26, 33, 300], vocab_size=500, seed=11)
    kwargs = {"compilation_config": {"mode": "VLLM_COMPILE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}} \
        if compiled else {}
    _assert_within_ties(f"llama 256-wide, {'compiled' if compiled else 'eager'}", path, prompts,
                        _generate(path, prompts, **kwargs))
