"""DSpark's context K/V under PCP (spec_decode/dspark_context.py): each rank projects its own rows and all-gathers
the K/V. Its drafts and tokens equal the replicated layout's (restore the target's layer outputs, project every
row everywhere) at PCP 2 and 4, greedy and seeded probabilistic, eager and compiled with PIECEWISE padding; the
bytes each rank receives equal the module docstring's formula, step by step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dspark_checkpoint import build_dspark_drafter
from engine_utils import random_prompts, record_steps

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.models.dspark import DSparkConfig, DSparkDrafter
from tandem.models.loader import load_weights, read_checkpoint
from tandem.spec_decode.dspark_context import CONTEXT_KV_ENV
from tandem.worker.pcp import pad_local, partition, restore

# Prompts longer than the 32-token budget span several chunks, so PCP segments start mid-prompt and decode rows
# share steps with prompt chunks.
LENGTHS = [70, 9, 45, 20]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
PIECEWISE = {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
GRAPHS = {"eager": {}, "padded": PIECEWISE, "compiled": {"mode": 3, **PIECEWISE}}  # padded: PIECEWISE, not compiled
K = 3


def _params(sampling: str) -> list[SamplingParams]:
    if sampling == "greedy":
        return [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(LENGTHS)
    # one greedy request among the sampled ones: it verifies against sampled drafts with their q
    return [SamplingParams(temperature=0.9, top_p=0.95, seed=50 + i, max_tokens=10, ignore_eos=True)
            if i != 1 else SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for i in range(len(LENGTHS))]


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny MLA target and a random drafter: its drafts are decided by the context K/V as well as the block,
    so a context row written to the wrong slot, or a wrong value, changes them. One K/V head makes a token's
    context K/V (2 layers x 2 x 16) half as wide as its two target layer outputs (2 x 64), as for real drafters."""
    target = tiny_checkpoints("deepseek_v3")
    return target, build_dspark_drafter(target, tmp_path_factory.mktemp("dspark-ctx"),
                                        overrides={"num_key_value_heads": 1})


def _run(monkeypatch, target: Path, drafter: Path, layout: str, pcp: int, sampling: str, graph: str) -> dict:
    monkeypatch.setenv(CONTEXT_KV_ENV, layout)  # read when each rank builds its proposer
    spec = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": K, "draft_sample_method": sampling}
    llm = LLM(str(target), **ENGINE, prefill_context_parallel_size=pcp, speculative_config=spec,
              compilation_config=GRAPHS[graph])
    try:
        steps = record_steps(llm, monkeypatch)
        prompts = random_prompts(LENGTHS, vocab_size=500, seed=23)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(sampling), use_tqdm=False)
        return {"tokens": [o.outputs[0].token_ids for o in outs],
                "drafts": [out.draft_token_ids for _, out in steps],
                "plans": [plan for plan, _ in steps],
                "gathered": llm.engine.spec_stats.draft_stats["context_gather_bytes"],
                "accepted": llm.engine.spec_stats.num_accepted_tokens}
    finally:
        llm.shutdown()


def _expected_bytes(plans: list, pcp: int, row_bytes: int) -> int:
    """The docstring's formula, P * max_local_tokens * row bytes, summed over the recorded steps."""
    total = 0
    for plan in plans:
        qsl = np.concatenate(([0], np.cumsum([len(r.token_ids) for r in plan.rows])))
        part = partition(qsl, np.array([r.is_prefill for r in plan.rows]), pcp)
        total += pcp * part.max_local_tokens * row_bytes
    return total


# "probabilistic" runs one greedy request among seeded sampled ones. Compiling costs minutes a run on 2 cores,
# so one compiled case (PCP 2); PCP 4 pads its steps as PIECEWISE does without compiling the pieces.
CASES = [(2, "greedy", "eager"), (2, "probabilistic", "eager"), (4, "greedy", "eager"),
         (4, "probabilistic", "padded"), pytest.param(2, "probabilistic", "compiled", marks=pytest.mark.slow)]


@pytest.mark.parametrize("pcp,sampling,graph", CASES)
def test_sharded_context_kv_drafts_equal_replicated(pair, monkeypatch, pcp, sampling, graph):
    target, drafter = pair
    sharded = _run(monkeypatch, target, drafter, "sharded", pcp, sampling, graph)
    replicated = _run(monkeypatch, target, drafter, "replicated", pcp, sampling, graph)
    where = f"PCP={pcp} {sampling} {graph}"
    assert len(sharded["drafts"]) == len(replicated["drafts"]), f"{where}: different number of steps"
    for i, (got, ref) in enumerate(zip(sharded["drafts"], replicated["drafts"], strict=True)):
        assert got == ref, f"{where}: step {i} drafted {got} sharded, {ref} replicated"
    assert sum(len(d) for step in sharded["drafts"] for d in step) > 0, f"{where}: nothing was drafted"
    assert sharded["tokens"] == replicated["tokens"], f"{where}: tokens differ"
    assert sharded["accepted"] == replicated["accepted"]
    cfg = json.loads((drafter / "config.json").read_text())
    kv_row = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # float32 cache
    aux_row = len(cfg["target_layer_ids"]) * cfg["target_hidden_size"] * 4
    assert sharded["gathered"] == _expected_bytes(sharded["plans"], pcp, kv_row), f"{where}: sharded bytes"
    assert replicated["gathered"] == _expected_bytes(replicated["plans"], pcp, aux_row), f"{where}: replicated bytes"
    assert sharded["gathered"] < replicated["gathered"]


def test_unknown_layout_is_named(pair, monkeypatch):
    target, drafter = pair
    monkeypatch.setenv(CONTEXT_KV_ENV, "sometimes")
    with pytest.raises(ConfigError, match=f"{CONTEXT_KV_ENV}='sometimes' .*sharded, replicated"):
        LLM(str(target), **ENGINE, speculative_config={"method": "dspark", "model": str(drafter),
                                                       "num_speculative_tokens": K})


@pytest.mark.parametrize("pcp", [2, 4])
def test_local_projection_restored_equals_global_projection(pair, pcp):
    """The sharded layout's index math on one rank's process: every rank's rows projected separately, padded,
    concatenated as the all-gather would and restored equal the projection of the global batch (decode rows,
    two prompt chunks of different lengths and graph padding)."""
    _, drafter_dir = pair
    cfg = DSparkConfig.from_folder(str(drafter_dir))
    drafter = DSparkDrafter(cfg, max_position=256)
    load_weights(drafter, read_checkpoint(str(drafter_dir)))
    for attn in drafter.attention_layers():
        attn.kv_cache = torch.zeros(attn.kv_cache_shape(1, 16))  # only its dtype is read
    qsl, is_prefill, num_padding = np.array([0, 1, 4, 41, 60]), np.array([False, False, True, True]), 4
    part = partition(qsl, is_prefill, pcp, num_padding)
    num_tokens = int(qsl[-1]) + num_padding
    torch.manual_seed(0)
    aux = torch.randn(num_tokens, len(cfg.target_layer_ids) * cfg.target_hidden_size)  # [T_global + padding, ..]
    positions = torch.randint(0, 200, (num_tokens,))
    with torch.inference_mode():
        gathered = torch.cat([pad_local(drafter.context_kv(aux[idx], positions[idx]), part)
                              for idx in map(torch.from_numpy, part.local_token_idx)])
        got = restore(gathered, part)  # [T_global + padding, L, 2, Hkv, D]
        ref = drafter.context_kv(aux, positions)
    real = int(qsl[-1])
    diff = (got[:real] - ref[:real]).abs().max().item()
    assert diff <= 1e-5, f"PCP={pcp}: restored local K/V differ from the global projection by {diff}"
    assert not got[real:].any(), "graph-padding rows must come back as zeros"
