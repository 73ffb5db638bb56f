"""PCP + speculative decoding (DESIGN §5): the target stays PCP-sharded while the MTP drafter runs
sharded (PCP-capable backend) or replicated (explicit non-PCP backend); greedy output equals PCP=1 and
non-speculative greedy, probabilistic output equals PCP=1 with the same seeds."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from engine_utils import random_prompts

from tandem import LLM, SamplingParams

# Several prompts exceed the 32-token budget, so PCP segments start mid-prompt.
LENGTHS = [4, 9, 17, 30, 45, 70]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
DRAFT_BACKEND = {"deepseek_v3": {"sharded": "PAGED_MLA", "replicated": "CONTIGUOUS_MLA"},
                 "glm4_moe": {"sharded": "PAGED_SDPA", "replicated": "CONTIGUOUS_SDPA"}}
K_FIXED = {"num_speculative_tokens": 2}
K_DYNAMIC = {"num_speculative_tokens_per_batch_size": [[3, 3], [5, 2], [8, 1]]}


def _params(sampling: str) -> list[SamplingParams]:
    if sampling == "greedy":
        return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(LENGTHS)
    return [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)
            for i in range(len(LENGTHS))]


def _run(path: Path, sampling: str, **kwargs) -> tuple[list[list[int]], str | None, dict]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        prompts = random_prompts(LENGTHS, vocab_size=500, seed=31)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(sampling), use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        return [o.outputs[0].token_ids for o in outs], llm.draft_mode, metrics
    finally:
        llm.shutdown()


@functools.lru_cache(maxsize=16)
def _reference(path: Path, sampling: str, spec_key: str) -> list[list[int]]:
    spec = None if spec_key == "none" else {"method": "mtp", **(K_FIXED if spec_key == "fixed" else K_DYNAMIC),
                                            "draft_sample_method": sampling}
    return _run(path, sampling, speculative_config=spec)[0]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("mode", ["sharded", "replicated"])
@pytest.mark.parametrize("sampling,k", [("greedy", "fixed"), ("greedy", "dynamic"), ("probabilistic", "fixed"),
                                        ("probabilistic", "dynamic")])
def test_pcp2_speculative_matches_pcp1(tiny_checkpoints, arch, mode, sampling, k):
    path = tiny_checkpoints(arch, num_mtp_layers=1)
    spec = {"method": "mtp", **(K_FIXED if k == "fixed" else K_DYNAMIC), "draft_sample_method": sampling,
            "attention_backend": DRAFT_BACKEND[arch][mode]}
    tokens, draft_mode, metrics = _run(path, sampling, prefill_context_parallel_size=2, speculative_config=spec)
    assert draft_mode == mode
    assert metrics["tandem:spec_decode_num_drafts"] > 0
    assert tokens == _reference(path, sampling, k), f"{arch} {mode} {sampling} {k}: PCP=2 differs from PCP=1"
    if sampling == "greedy":
        assert tokens == _reference(path, sampling, "none"), "speculative greedy differs from plain greedy"
