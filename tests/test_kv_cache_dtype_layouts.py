"""Layout invariance with a narrow KV cache (issue 46, must-show 1), multi-rank over gloo: with the same
kv_cache_dtype, PCP 2 and 4 (replicated and sharded KV) and TP 2 give greedy tokens identical to one rank on tiny
MLA (deepseek_v3) and GQA (glm4_moe) checkpoints, with MTP drafting (sharded and replicated draft modes) and
without. The prompts chunk (a 32-token budget), share a prefix (prefix-cache hits) and, with a small pool, preempt;
the PCP all-gather then moves the stored bytes (fp8: one byte a value)."""

from __future__ import annotations

import functools

import pytest
from engine_utils import random_prompts

from tandem import LLM, SamplingParams

PREFIX = random_prompts([40], vocab_size=500, seed=5)[0]
PROMPTS = random_prompts([4, 9, 17, 30, 45, 70], vocab_size=500, seed=31) + [PREFIX + [7, 8, 9], PREFIX + [11, 12]]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32, "block_size": 4}
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
DRAFT_BACKEND = {"deepseek_v3": {"sharded": "PAGED_MLA", "replicated": "CONTIGUOUS_MLA"},
                 "glm4_moe": {"sharded": "PAGED_SDPA", "replicated": "CONTIGUOUS_SDPA"}}
LAYOUTS = {
    "pcp2": {"prefill_context_parallel_size": 2, "pcp_kv_layout": "replicated"},
    "pcp4": {"prefill_context_parallel_size": 4, "pcp_kv_layout": "replicated"},
    "pcp2-sharded": {"prefill_context_parallel_size": 2, "pcp_kv_layout": "sharded"},
    "pcp4-sharded": {"prefill_context_parallel_size": 4, "pcp_kv_layout": "sharded"},
    "tp2": {"tensor_parallel_size": 2},
}
SHARDS = {"pcp2-sharded": 2, "pcp4-sharded": 4}  # per-rank pools: the single rank holds them all in one


def _spec(arch: str, drafter: str | None) -> dict | None:
    if drafter is None:
        return None
    mode = drafter.removeprefix("mtp-")
    return {"method": "mtp", "num_speculative_tokens": 2, "attention_backend": DRAFT_BACKEND[arch][mode]}


def _run(path: str, **kwargs) -> tuple[list[list[int]], dict[str, float]]:
    llm = LLM(path, **{**ENGINE, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", 0.0) for m in llm.get_metrics()}
        return [o.outputs[0].token_ids for o in outs], metrics
    finally:
        llm.shutdown()


@functools.lru_cache(maxsize=16)
def _single_rank(path: str, kv: str, blocks: int | None, calculate_kv_scales: bool = False) -> list[list[int]]:
    return _run(path, kv_cache_dtype=kv, num_gpu_blocks_override=blocks,
                max_model_len=None if blocks is None else 128, calculate_kv_scales=calculate_kv_scales)[0]


CASES = [  # (arch, kv_cache_dtype, layout, drafter, per-rank KV blocks or None = plenty)
    ("deepseek_v3", "fp8", "pcp2", None, 48),  # 48 blocks of 4: the 8 requests preempt
    ("deepseek_v3", "fp8", "pcp4", "mtp-replicated", None),
    ("deepseek_v3", "fp8", "pcp2-sharded", "mtp-sharded", None),
    ("deepseek_v3", "fp8", "pcp4-sharded", None, 12),
    ("deepseek_v3", "fp8", "tp2", "mtp-sharded", None),
    ("deepseek_v3", "fp8_e5m2", "pcp2-sharded", "mtp-replicated", None),
    ("deepseek_v3", "bfloat16", "pcp4-sharded", "mtp-sharded", None),
    ("deepseek_v3", "bfloat16", "tp2", None, None),
    ("glm4_moe", "fp8", "pcp2", "mtp-replicated", None),
    ("glm4_moe", "fp8", "pcp4", None, None),
    ("glm4_moe", "fp8", "pcp2-sharded", None, 24),
    ("glm4_moe", "fp8", "pcp4-sharded", "mtp-sharded", None),
    ("glm4_moe", "fp8", "tp2", "mtp-sharded", None),
    ("glm4_moe", "fp8_e5m2", "pcp4-sharded", "mtp-replicated", None),
    ("glm4_moe", "bfloat16", "pcp2", "mtp-sharded", None),
    ("glm4_moe", "bfloat16", "tp2", None, None),
]


@pytest.mark.parametrize("arch,kv,layout,drafter,blocks", CASES)
def test_narrow_kv_greedy_matches_single_rank(tiny_checkpoints, arch, kv, layout, drafter, blocks):
    path = str(tiny_checkpoints(arch, num_mtp_layers=1))
    tokens, metrics = _run(path, kv_cache_dtype=kv, speculative_config=_spec(arch, drafter),
                           num_gpu_blocks_override=blocks, max_model_len=None if blocks is None else 128,
                           **LAYOUTS[layout])
    ref = _single_rank(path, kv, None if blocks is None else blocks * SHARDS.get(layout, 1))
    assert tokens == ref, f"{arch} kv_cache_dtype={kv} {layout} {drafter}: greedy tokens differ from one rank"
    assert metrics["tandem:prefix_cache_hits"] > 0, "the shared-prefix prompts should hit cached blocks"
    if drafter is not None:
        assert metrics["tandem:spec_decode_num_drafts"] > 0
    if blocks is not None:
        assert metrics["tandem:num_preemptions"] > 0, "the small pools should have forced preemption"


CALCULATED_SCALE_CASES = [  # (arch, layout, drafter): calculate_kv_scales, fp8
    ("deepseek_v3", "pcp2-sharded", "mtp-sharded"),
    ("deepseek_v3", "pcp4", "mtp-replicated"),
    ("deepseek_v3", "tp2", None),
    ("glm4_moe", "pcp2", "mtp-replicated"),
    ("glm4_moe", "pcp4-sharded", "mtp-sharded"),
    ("glm4_moe", "tp2", "mtp-sharded"),
]


@pytest.mark.parametrize("arch,layout,drafter", CALCULATED_SCALE_CASES)
def test_calculated_kv_scales_match_single_rank(tiny_checkpoints, arch, layout, drafter):
    """calculate_kv_scales: the scales come from the written rows after the PCP gather, reduced over TP and PCP,
    so every layout stores what one rank stores: the same greedy tokens."""
    path = str(tiny_checkpoints(arch, num_mtp_layers=1))
    tokens, metrics = _run(path, kv_cache_dtype="fp8", calculate_kv_scales=True,
                           speculative_config=_spec(arch, drafter), **LAYOUTS[layout])
    assert tokens == _single_rank(path, "fp8", None, True), f"{arch} {layout} {drafter}: differs from one rank"
    if drafter is not None:
        assert metrics["tandem:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_pcp_gather_moves_the_stored_bytes(tiny_checkpoints, arch):
    """Replicated PCP 2 gathers every prefill token's new K/V: in fp8 one byte a value, a quarter of float32's
    (the gathered hidden states and logits rows are the same in both, so the total drops by less than 4x)."""
    path = str(tiny_checkpoints(arch))
    gathered = {kv: _run(path, kv_cache_dtype=kv, prefill_context_parallel_size=2, pcp_kv_layout="replicated")[1][
                    "tandem:pcp_gathered_bytes"]
                for kv in ("auto", "bfloat16", "fp8")}
    assert gathered["fp8"] < gathered["bfloat16"] < gathered["auto"], gathered
