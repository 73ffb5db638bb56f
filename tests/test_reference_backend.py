"""A backend added in one file (tandem/attention/backends/reference_sdpa.py: REFERENCE_SDPA and REFERENCE_MLA,
registered by being in the backends package) and selected by name passes the HF-parity and PCP checks: the parity
and multi-rank tests' own cases, rerun with it. It builds no metadata of its own (the step's batch is enough)."""

from __future__ import annotations

import pytest
import test_hf_parity as parity
import test_multirank as multirank
import torch
from engine_utils import metric, random_prompts, tandem_last_logits
from hf_oracle import hf_greedy, hf_last_logits

from tandem import LLM
from tandem.attention.backend import registered_backends

# one GQA and one MLA architecture for the HF checks, one of each for the multi-rank checks
BACKEND = {"llama": "REFERENCE_SDPA", "deepseek_v3": "REFERENCE_MLA", "glm4_moe": "REFERENCE_SDPA"}


def test_the_reference_backends_are_registered_and_build_no_metadata():
    for name in ("REFERENCE_SDPA", "REFERENCE_MLA"):
        cls = registered_backends()[name]
        assert "prepare_metadata" not in vars(cls), f"{name} plans nothing of its own"
        assert cls.supports_pcp() and not cls.automatic


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def arch_ckpt(request, tiny_checkpoints):
    path = tiny_checkpoints(request.param)
    prompts = random_prompts(parity.PROMPT_LENGTHS, vocab_size=500, seed=len(request.param))
    return request.param, path, prompts, hf_greedy(path, prompts, parity.MAX_TOKENS)


@pytest.mark.parametrize("regime", list(parity.REGIMES))
def test_reference_backend_greedy_tokens_match_hf(arch_ckpt, regime):
    arch, path, prompts, expected = arch_ckpt
    llm = LLM(str(path), dtype="float32", attention_config={"backend": BACKEND[arch]}, **parity.REGIMES[regime])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], parity.GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        got = out.outputs[0].token_ids
        assert got == ref, f"{arch}/{regime} on {BACKEND[arch]}: prompt {i} gave {got}, HF {ref}"
    if regime == "preempt":
        assert metric(llm, "tandem:num_preemptions") > 0, "the small KV pool should have forced preemption"


def test_reference_backend_final_position_logits_match_hf(arch_ckpt):
    arch, path, prompts, _ = arch_ckpt
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False, attention_config={"backend": BACKEND[arch]})
    for ids in prompts[-3:]:
        diff = (tandem_last_logits(llm, ids) - hf_last_logits(path, ids)).abs().max().item()
        assert diff < 1e-4, f"{arch} on {BACKEND[arch]}: final logits differ from HF by {diff:.2e}"


# two backends that sum in different orders (the reference SDPA over two ranks' log-sum-exp merge, the default
# backend's kernel on one): test_multirank's 1e-4 for one backend over layouts read 1.1e-4 here on glm4_moe on an
# avx2 machine (AMD EPYC, 2026-12-06), where the native kernels sum 8 lanes at a time; the tokens stay exactly equal
PCP_LOGPROB_TOL = 3e-4


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_reference_backend_pcp2_matches_single_rank(tiny_checkpoints, arch):
    """The multi-rank test's PCP=2 case on the reference backend against the default backend on one rank."""
    path = str(tiny_checkpoints(arch))
    prompts = random_prompts(multirank.PROMPT_LENGTHS, vocab_size=500, seed=21)
    ref_tokens, ref_logprobs = multirank._run(path, prompts)
    tokens, logprobs = multirank._run(path, prompts, prefill_context_parallel_size=2,
                                      attention_config={"backend": BACKEND[arch]})
    for i, (got, ref) in enumerate(zip(tokens, ref_tokens, strict=True)):
        assert got == ref, f"{arch} pcp2 on {BACKEND[arch]}: prompt {i} gave {got}, single rank {ref}"
    for i, (got, ref) in enumerate(zip(logprobs, ref_logprobs, strict=True)):
        ids = sorted(ref)
        diff = (torch.tensor([got[t] for t in ids]) - torch.tensor([ref[t] for t in ids])).abs().max().item()
        assert diff < PCP_LOGPROB_TOL, \
            f"{arch} pcp2 on {BACKEND[arch]}: prompt {i} final-position log-probs differ by {diff:.2e}"
