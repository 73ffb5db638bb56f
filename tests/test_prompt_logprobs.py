"""SamplingParams.prompt_logprobs against Hugging Face: each prompt token's logprob given its prefix equals
HF's log-softmax (float32, 1e-4), with the prompt prefilled in 16-token chunks, on one rank and over two PCP
ranks; the first token has none; a repeated prompt is recomputed rather than served from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from engine_utils import random_prompts
from hf_oracle import load_hf_model

from tandem import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_prompt_logprobs_match_hf_chunked_and_under_pcp(tiny_checkpoints, arch):
    path = tiny_checkpoints(arch)
    prompt = random_prompts([45], vocab_size=500, seed=9)[0]
    with torch.inference_mode():
        ref = load_hf_model(path)(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [T, V]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for pcp in (1, 2):
        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, prefill_context_parallel_size=pcp)
        outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)  # the 2nd would hit
        llm.shutdown()
        for out in outs:
            got = out.prompt_logprobs
            assert got is not None and len(got) == len(prompt) and got[0] is None
            for p in range(1, len(prompt)):
                entry, token = got[p], prompt[p]
                assert abs(entry[token] - ref[p - 1, token].item()) < 1e-4, f"{arch} PCP={pcp} position {p}"
                top = set(ref[p - 1].topk(3).indices.tolist())
                assert top <= set(entry) and len(entry) <= 4, f"{arch} PCP={pcp} position {p}: {entry}"
        assert outs[1].num_cached_tokens == 0, "a prompt_logprobs request must not take prefix hits"
