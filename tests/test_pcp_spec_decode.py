"""PCP + speculative decoding (DESIGN §5): the target stays PCP-sharded while the MTP drafter runs
sharded (PCP-capable backend) or replicated (explicit non-PCP backend); greedy output equals PCP=1 and
non-speculative greedy, probabilistic output equals PCP=1 with the same seeds."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from engine_utils import random_prompts, run_tokens, spec_params

from tandem import LLM

# Several prompts exceed the 32-token budget, so PCP segments start mid-prompt.
LENGTHS = [4, 9, 17, 30, 45, 70]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
DRAFT_BACKEND = {"deepseek_v3": {"sharded": "PAGED_MLA", "replicated": "CONTIGUOUS_MLA"},
                 "glm4_moe": {"sharded": "PAGED_SDPA", "replicated": "CONTIGUOUS_SDPA"}}
K_FIXED = {"num_speculative_tokens": 2}
K_DYNAMIC = {"num_speculative_tokens_per_batch_size": [[3, 3], [5, 2], [8, 1]]}
PIECEWISE = {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32]}


def _run(path: Path, sampling: str, **kwargs) -> tuple[list[list[int]], str | None, dict]:
    prompts = random_prompts(LENGTHS, vocab_size=500, seed=31)
    return run_tokens(path, prompts, spec_params(sampling, len(LENGTHS)), **ENGINE, **kwargs)


@functools.lru_cache(maxsize=16)
def _reference(path: Path, sampling: str, spec_key: str) -> list[list[int]]:
    spec = None if spec_key == "none" else {"method": "mtp", **(K_FIXED if spec_key == "fixed" else K_DYNAMIC),
                                            "draft_sample_method": sampling}
    return _run(path, sampling, speculative_config=spec)[0]


ALL_SAMPLING_K = [("greedy", "fixed"), ("greedy", "dynamic"), ("probabilistic", "fixed"), ("probabilistic", "dynamic")]
# The whole matrix: PCP in {2, 4} x {eager, PIECEWISE} x {sharded, replicated} x sampling x K.
CASES = [(pcp, graph, mode, sampling, k) for pcp in (2, 4) for graph in ("eager", "piecewise")
         for mode in ("sharded", "replicated") for sampling, k in ALL_SAMPLING_K]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("pcp,graph,mode,sampling,k", CASES)
def test_pcp_speculative_matches_pcp1(tiny_checkpoints, arch, pcp, graph, mode, sampling, k):
    path = tiny_checkpoints(arch, num_mtp_layers=1)
    spec = {"method": "mtp", **(K_FIXED if k == "fixed" else K_DYNAMIC), "draft_sample_method": sampling,
            "attention_backend": DRAFT_BACKEND[arch][mode]}
    extra = {"compilation_config": PIECEWISE} if graph == "piecewise" else {}
    tokens, draft_mode, metrics = _run(path, sampling, prefill_context_parallel_size=pcp, speculative_config=spec,
                                       **extra)
    assert draft_mode == mode
    assert metrics["tandem:spec_decode_num_drafts"] > 0
    assert tokens == _reference(path, sampling, k), f"{arch} PCP={pcp} {graph} {mode} {sampling} {k} != PCP=1"
    if sampling == "greedy":
        assert tokens == _reference(path, sampling, "none"), "speculative greedy differs from plain greedy"


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_piecewise_padding_runs_and_changes_nothing(tiny_checkpoints, arch):
    """Single rank, in-process so the runner can be inspected: steps are really padded (padding tokens ran,
    every capture size warmed up in the draft mode's path) and the tokens equal eager execution."""
    path = tiny_checkpoints(arch, num_mtp_layers=1)
    spec = {"method": "mtp", **K_FIXED}
    llm = LLM(str(path), **ENGINE, speculative_config=spec, compilation_config=PIECEWISE)
    prompts = random_prompts(LENGTHS, vocab_size=500, seed=31)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], spec_params("greedy", len(LENGTHS)), use_tqdm=False)
    runner = llm.engine.executor.runner
    assert runner.warmed_up_sizes == [32, 24, 16, 8, 4, 2, 1]
    assert runner.num_padding_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == _reference(path, "greedy", "fixed")


def test_draft_bound_covers_a_request_that_accepted_everything():
    """The seed PR's review finding. Step n: the longest request verifies [t, d1, d2, d3] at positions 36..39.
    It accepts all three drafts and the bonus token, so step n+1 verifies at positions 40..43 and its draft
    decodes after a full acceptance sit at positions 44 and 45 (46 keys). The bound from step n+1's own batch
    covers them; the previous step's bound (40 + 3 = 43) does not, and the proposer refuses it loudly."""
    from tandem.spec_decode.mtp_proposer import DraftDecodeMetadata, draft_max_seq_len
    from tandem.step_plan import RowSampling, ScheduledRow, StepPlan
    from tandem.worker.input_batch import prepare_inputs

    k, block_size, max_model_len = 3, 16, 128
    greedy = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)

    def step(start: int) -> StepPlan:
        long_row = ScheduledRow("long", [5, 6, 7, 8], start, [0, 1, 2, 3], is_prefill=False, sampling=greedy,
                                num_draft_tokens=k)
        short_row = ScheduledRow("short", [9, 10], 7, [4], is_prefill=False, sampling=greedy, num_draft_tokens=1)
        return StepPlan([long_row, short_row], num_spec_tokens=k)

    previous, current = prepare_inputs(step(36), block_size, "cpu"), prepare_inputs(step(40), block_size, "cpu")
    stale, fresh = draft_max_seq_len(previous, k, max_model_len), draft_max_seq_len(current, k, max_model_len)
    assert stale == 43 and fresh == 47
    # the long row accepted everything (last valid position 43): its second draft decode runs at position 45
    positions = torch.tensor([45, 9])
    meta = DraftDecodeMetadata(step(40), current, block_size, max_model_len, fresh).at(positions)
    assert int(meta.seq_lens_cpu.max()) == 46 <= fresh
    with pytest.raises(RuntimeError, match="draft attention bound 43 does not cover a draft row of 46 keys"):
        DraftDecodeMetadata(step(40), current, block_size, max_model_len, stale).at(positions)
    assert draft_max_seq_len(current, k, max_model_len=45) == 45  # clamped to max_model_len
