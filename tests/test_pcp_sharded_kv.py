"""Owner-sharded KV under PCP (pcp_kv_layout sharded) through the engine, multi-rank over gloo: greedy tokens and
log-probs equal the single rank (and the replicated layout) on tiny MLA+MoE and GQA checkpoints, PCP 2 and 4,
with chunked prefill, prefix caching, preemption, MTP in both draft modes, DSpark and n-gram, eager and
PIECEWISE; and a per-rank KV pool of C tokens serves a prompt of 0.95 P C (the replicated layout cannot)."""

from __future__ import annotations

import functools

import pytest
from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL
from tandem.config import ConfigError

# Prompts longer than the 32-token budget start PCP segments mid-prompt; the last two share a 40-token prefix
# (10 blocks of 4: prefix-cache hits on sharded blocks), and 4-token blocks spread every request over the ranks.
PREFIX = random_prompts([40], vocab_size=500, seed=5)[0]
PROMPTS = random_prompts([4, 9, 17, 30, 45, 70], vocab_size=500, seed=31) + [PREFIX + [7, 8, 9], PREFIX + [11, 12]]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32, "block_size": 4}
PIECEWISE = {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32]}
DRAFT_BACKEND = {"deepseek_v3": {"sharded": "PAGED_MLA", "replicated": "CONTIGUOUS_MLA"},
                 "glm4_moe": {"sharded": "PAGED_SDPA", "replicated": "CONTIGUOUS_SDPA"}}
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _spec(arch: str, drafter: str | None) -> dict | None:
    if drafter is None:
        return None
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    if drafter == "dspark":
        return {"method": "dspark", "num_speculative_tokens": 2}
    method, mode = drafter.split("-")  # "mtp-sharded" / "mtp-replicated"
    return {"method": method, "num_speculative_tokens": 2, "attention_backend": DRAFT_BACKEND[arch][mode]}


def _run(path: str, **kwargs) -> tuple[list[list[int]], list[list[dict[int, float]]], dict[str, float]]:
    llm = LLM(path, **{**ENGINE, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", 0.0) for m in llm.get_metrics()}
        logprobs = [[dict(pos) for pos in o.outputs[0].logprobs] for o in outs]
        return [o.outputs[0].token_ids for o in outs], logprobs, metrics
    finally:
        llm.shutdown()


@functools.lru_cache(maxsize=8)
def _single_rank(path: str, blocks: int | None) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    tokens, logprobs, _ = _run(path, num_gpu_blocks_override=blocks, max_model_len=None if blocks is None else 128)
    return tokens, logprobs


def _assert_logprobs_close(got: list[list[dict[int, float]]], want: list[list[dict[int, float]]]) -> None:
    for g_req, w_req in zip(got, want, strict=True):
        for g, w in zip(g_req, w_req, strict=True):
            assert g.keys() == w.keys()
            assert max(abs(g[t] - w[t]) for t in g) < 1e-4


CASES = [  # (arch, PCP, drafter, graph mode, per-rank KV blocks or None = plenty)
    ("deepseek_v3", 2, None, "eager", 24),  # 24 blocks of 4 per rank: 8 requests must preempt
    ("deepseek_v3", 4, "mtp-sharded", "eager", None),
    ("deepseek_v3", 2, "mtp-sharded", "piecewise", None),
    ("deepseek_v3", 2, "mtp-replicated", "piecewise", None),
    ("glm4_moe", 2, None, "eager", 24),
    ("glm4_moe", 2, "mtp-replicated", "eager", None),
    ("glm4_moe", 4, "mtp-sharded", "piecewise", None),
    ("glm4_moe", 2, "ngram", "eager", None),
]


@pytest.mark.parametrize("arch,pcp,drafter,graph,blocks", CASES)
def test_sharded_kv_matches_single_rank(tiny_checkpoints, arch, pcp, drafter, graph, blocks):
    path = str(tiny_checkpoints(arch, num_mtp_layers=1))
    extra = {"compilation_config": PIECEWISE} if graph == "piecewise" else {}
    tokens, logprobs, metrics = _run(path, prefill_context_parallel_size=pcp, pcp_kv_layout="sharded",
                                     speculative_config=_spec(arch, drafter), num_gpu_blocks_override=blocks,
                                     max_model_len=None if blocks is None else 128, **extra)
    # the single rank holds the P per-rank pools in one
    ref_tokens, ref_logprobs = _single_rank(path, None if blocks is None else blocks * pcp)
    assert tokens == ref_tokens, f"{arch} PCP={pcp} {drafter} {graph}: sharded KV differs from one rank"
    if drafter is None:
        _assert_logprobs_close(logprobs, ref_logprobs)
    else:
        assert metrics["tandem:spec_decode_num_drafts"] > 0
    assert metrics["tandem:prefix_cache_hits"] > 0, "the shared-prefix prompts should hit sharded blocks"
    if blocks is not None:
        assert metrics["tandem:num_preemptions"] > 0, "the small per-rank pools should have forced preemption"


def test_sharded_equals_replicated_with_dspark():
    """DSpark (always a replicated drafter, with a replicated drafter cache) beside a sharded target, PCP 2."""
    spec = {"method": "dspark", "model": str(DEFAULT_DSPARK), "num_speculative_tokens": 2}
    sharded, _, metrics = _run(str(DEFAULT_MODEL), prefill_context_parallel_size=2, pcp_kv_layout="sharded",
                               speculative_config=spec)
    replicated, _, _ = _run(str(DEFAULT_MODEL), prefill_context_parallel_size=2, speculative_config=spec)
    assert metrics["tandem:spec_decode_num_drafts"] > 0
    assert sharded == replicated


@pytest.mark.parametrize("pcp", [2, 4])
def test_per_rank_pool_of_c_tokens_serves_a_prompt_of_095_p_c(tiny_checkpoints, pcp):
    """Capacity: with a KV pool per rank of C = 128 tokens, sharded KV runs a prompt of 0.95 P C tokens and gives
    the single rank's tokens; replicated KV cannot even be configured past C."""
    path = str(tiny_checkpoints("deepseek_v3"))
    per_rank_blocks, block_size = 8, 16  # C = 128 tokens
    capacity = pcp * per_rank_blocks * block_size
    prompt = random_prompts([int(0.95 * capacity)], vocab_size=500, seed=pcp)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = {"dtype": "float32", "block_size": block_size, "max_model_len": capacity, "max_num_batched_tokens": 256}
    llm = LLM(path, **engine, prefill_context_parallel_size=pcp, pcp_kv_layout="sharded",
              num_gpu_blocks_override=per_rank_blocks)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == 3
    single = LLM(path, **engine, num_gpu_blocks_override=capacity // block_size)
    try:
        assert out.outputs[0].token_ids == single.generate([{"prompt_token_ids": prompt}], params,
                                                           use_tqdm=False)[0].outputs[0].token_ids
    finally:
        single.shutdown()
    with pytest.raises(ConfigError, match="pcp_kv_layout='sharded'"):
        LLM(path, **engine, prefill_context_parallel_size=pcp, num_gpu_blocks_override=per_rank_blocks)


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
def test_sharded_kv_on_a_backend_that_cannot_attend_over_it_is_named(tiny_checkpoints, arch):
    path = str(tiny_checkpoints(arch))
    reference = "REFERENCE_MLA" if arch == "deepseek_v3" else "REFERENCE_SDPA"
    with pytest.raises(ValueError, match=f"{reference}' does not attend over owner-sharded KV"):
        LLM(path, prefill_context_parallel_size=2, pcp_kv_layout="sharded", attention_config={"backend": reference})


def test_unknown_kv_layout_is_named():
    with pytest.raises(ConfigError, match="pcp_kv_layout='sideways'.*replicated, sharded"):
        LLM(str(DEFAULT_MODEL), prefill_context_parallel_size=2, pcp_kv_layout="sideways")
