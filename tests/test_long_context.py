"""Long prompts: a ~4k-token prompt prefilled in chunks under PCP=2 gives the single-rank tokens and final
log-probs (within 1e-4), for MLA (PAGED_MLA: expanded long rows, in-place absorbed decodes) and GQA
(PAGED_SDPA); and at one rank every way of reading keys (prefix + causal diagonal, in-place short rows, the
padded gather) agrees."""

from __future__ import annotations

import pytest
import torch
from engine_utils import random_prompts

from tandem import LLM, SamplingParams, native

VOCAB = 512
PROMPT_LENGTHS = [4000, 1500, 40]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 1024, "max_model_len": 4200}
OVERRIDES = {"max_position_embeddings": 4608}


def _run(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], list[dict[int, float]]]:
    llm = LLM(path, **ENGINE, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=VOCAB)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs[-1] for o in outs]


def _assert_same(got: tuple, ref: tuple, what: str) -> None:
    for i, (a, b) in enumerate(zip(got[0], ref[0], strict=True)):
        assert a == b, f"{what}: prompt {i} gave {a}, reference {b}"
    for i, (a, b) in enumerate(zip(got[1], ref[1], strict=True)):
        ids = sorted(b)
        diff = (torch.tensor([a[t] for t in ids]) - torch.tensor([b[t] for t in ids])).abs().max().item()
        assert diff < 1e-4, f"{what}: prompt {i} final-position log-probs differ by {diff:.2e}"


@pytest.fixture(scope="module", params=["deepseek_v3", "llama"])
def long_reference(request, tiny_checkpoints):
    path = str(tiny_checkpoints(request.param, overrides=OVERRIDES))
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=500, seed=5)
    return request.param, path, prompts, _run(path, prompts)


def test_long_prompt_pcp2_chunked_matches_single_rank(long_reference):
    arch, path, prompts, ref = long_reference
    _assert_same(_run(path, prompts, prefill_context_parallel_size=2), ref, f"{arch} PCP=2")


def test_long_prompt_key_reads_agree(long_reference, monkeypatch):
    """The padded gather of every short row (the off-CPU path) and the absorbed form of MLA's long rows give the
    tokens of the default native-kernel / cost-formula choice."""
    arch, path, prompts, ref = long_reference
    monkeypatch.setitem(native._state, "ok", False)  # the reference read them through the native kernel
    monkeypatch.setattr("tandem.attention.metadata.IN_PLACE_MIN_KEYS", 10**9)
    monkeypatch.setattr("tandem.attention.metadata.GATHER_MAX_KEYS", 10**9)
    if arch == "deepseek_v3":
        monkeypatch.setattr("tandem.attention.backends.paged_mla.prefers_expanded", lambda *a: False)
    _assert_same(_run(path, prompts), ref, f"{arch} gather + absorbed")


@pytest.mark.parametrize("pcp", [2, 4])
def test_long_prompt_pcp_with_a_sharded_mtp_drafter_gives_the_single_ranks_tokens(tiny_checkpoints, pcp):
    """MLA under replicated PCP splits the keys of prompt steps whose rows see two keys a query or more (every query
    over every P-th block, partials merged by LSE; worker/pcp_hooks.py); an MTP drafter sharded like the target runs
    its step 0 on the same split. Greedy drafting at PCP=2 and 4 gives no-spec's single-rank tokens."""
    path = str(tiny_checkpoints("deepseek_v3", overrides=OVERRIDES, num_mtp_layers=1))
    prompts = random_prompts([1200, 300, 40], vocab_size=500, seed=9)
    engine = {"dtype": "float32", "max_num_batched_tokens": 256, "max_model_len": 1400}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for name, kwargs in (("single rank", {}), ("PCP + MTP", {"prefill_context_parallel_size": pcp,
                         "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})):
        llm = LLM(path, **engine, **kwargs)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.shutdown()
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["PCP + MTP"] == tokens["single rank"]
