"""EAGLE-3 under PCP and TP (DESIGN §5's EAGLE-3 rows), multi-rank over gloo: the head runs sharded (PCP-capable
backend: rank-local aux states, the target's metadata) or replicated (explicit non-PCP backend: restored global aux
states), its KV replicated or owner-sharded like the target's; greedy equals single rank and non-speculative greedy,
probabilistic equals single rank with the same seeds."""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest
from eagle3_checkpoint import build_eagle3_head
from engine_utils import random_prompts, run_tokens, spec_params

# Several prompts exceed the 32-token budget, so PCP segments start mid-prompt.
LENGTHS = [4, 9, 17, 30, 45, 70]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
DRAFT_BACKEND = {"sharded": "PAGED_SDPA", "replicated": "CONTIGUOUS_SDPA"}
PIECEWISE = {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32]}


def _run(path: Path, sampling: str, **kwargs) -> tuple[list[list[int]], str | None, dict]:
    prompts = random_prompts(LENGTHS, vocab_size=500, seed=31)
    return run_tokens(path, prompts, spec_params(sampling, len(LENGTHS)), **ENGINE, **kwargs)


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    target = tiny_checkpoints("llama")
    counts = collections.Counter(t for out in _single(target, "greedy", None)[0] for t in out)
    head = build_eagle3_head(target, tmp_path_factory.mktemp("eagle3-pcp"), aux_layer_ids=[0, 1, 2],
                             draft_token_ids=[t for t, _ in counts.most_common(4)])
    return target, head


@functools.lru_cache(maxsize=8)
def _single(path: Path, sampling: str, head: Path | None) -> tuple[list[list[int]], tuple[float, float]]:
    """Single-rank tokens and (drafts, accepted drafts)."""
    spec = None if head is None else {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                      "draft_sample_method": sampling}
    tokens, _, m = _run(path, sampling, speculative_config=spec)
    return tokens, (m.get("tandem:spec_decode_num_draft_tokens", 0), m.get("tandem:spec_decode_num_accepted_tokens", 0))


CASES = [  # (pcp, tp, draft mode, KV layout, graph, sampling)
    (2, 1, "sharded", "replicated", "eager", "greedy"),
    (2, 1, "replicated", "replicated", "eager", "greedy"),
    (2, 1, "sharded", "sharded", "eager", "greedy"),
    (2, 1, "replicated", "sharded", "eager", "greedy"),
    (2, 1, "sharded", "replicated", "piecewise", "greedy"),
    (2, 1, "replicated", "replicated", "piecewise", "probabilistic"),
    (2, 1, "sharded", "sharded", "eager", "probabilistic"),
    (1, 2, "sharded", "replicated", "eager", "greedy"),
]


@pytest.mark.parametrize("pcp,tp,mode,kv,graph,sampling", CASES)
def test_pcp_eagle3_matches_single_rank(pair, pcp, tp, mode, kv, graph, sampling):
    target, head = pair
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_sample_method": sampling,
            "attention_backend": DRAFT_BACKEND[mode]}
    extra = {"compilation_config": PIECEWISE} if graph == "piecewise" else {}
    extra["pcp_kv_layout"] = kv
    tokens, draft_mode, metrics = _run(target, sampling, prefill_context_parallel_size=pcp, tensor_parallel_size=tp,
                                       speculative_config=spec, **extra)
    if pcp > 1:
        assert draft_mode == mode
    single, (drafted, accepted) = _single(target, sampling, head)
    assert tokens == single, f"PCP={pcp} TP={tp} {mode} {kv} {graph} {sampling} != 1 rank"
    assert accepted > 0, "no draft accepted on one rank: the accept path is untested"
    assert (metrics["tandem:spec_decode_num_draft_tokens"], metrics["tandem:spec_decode_num_accepted_tokens"]) \
        == (drafted, accepted), "acceptance differs from one rank"
    if sampling == "greedy":
        assert tokens == _single(target, sampling, None)[0], "speculative greedy differs from plain greedy"


@pytest.mark.parametrize("mode", ["sharded", "replicated"])
def test_bfloat16_head_under_pcp_equals_non_speculative(pair, mode):
    """draft_dtype "bfloat16" under a float32 target, PCP 2 with sharded KV: the head's bf16 states, K/V and drafts
    cross the ranks in both draft modes; greedy output stays non-speculative greedy."""
    target, head = pair
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_dtype": "bfloat16",
            "attention_backend": DRAFT_BACKEND[mode]}
    tokens, draft_mode, metrics = _run(target, "greedy", prefill_context_parallel_size=2, pcp_kv_layout="sharded",
                                       speculative_config=spec)
    assert draft_mode == mode
    assert tokens == _single(target, "greedy", None)[0], f"{mode}: bf16 head's greedy output differs"
    assert metrics["tandem:spec_decode_num_accepted_tokens"] > 0
