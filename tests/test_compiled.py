"""compilation_config.mode VLLM_COMPILE: torch.compile'd pieces between the opaque attention / MoE / collective ops
give the same greedy tokens as eager on every tiny architecture, with PCP=2 and with MTP drafting; a compile
failure falls back to eager with one warning; bad modes are named."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.compilation.compile import CompiledForward
from tandem.config import ConfigError

LENGTHS = [3, 11, 26, 40]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
SIZES = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}


def _greedy(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(LENGTHS, vocab_size=500, seed=5)],
                            PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "glm4_moe", "deepseek_v3", "glm4_moe_lite"])
def test_compiled_matches_eager(tiny_checkpoints, arch):
    path = tiny_checkpoints(arch)
    eager = _greedy(path)
    compiled = _greedy(path, compilation_config={"mode": "VLLM_COMPILE", **SIZES})
    assert compiled == eager


# MLA under PCP=2 with sharded MTP drafting; GQA with MTP on one rank (each compile costs minutes on 2 cores)
@pytest.mark.parametrize("arch,pcp", [("deepseek_v3", 2), ("glm4_moe", 1)])
def test_compiled_with_mtp_matches_eager(tiny_checkpoints, arch, pcp):
    path = tiny_checkpoints(arch, num_mtp_layers=1)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    eager = _greedy(path)
    compiled = _greedy(path, prefill_context_parallel_size=pcp, speculative_config=spec,
                       compilation_config={"mode": 3, "cudagraph_mode": "PIECEWISE", **SIZES})
    assert compiled == eager


def test_failed_compile_falls_back_to_eager_with_one_warning(caplog):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    wrapped = CompiledForward(forward, "test forward")

    def broken(*_: object) -> torch.Tensor:
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("inductor is broken"), None)

    wrapped.compiled = broken
    with caplog.at_level(logging.WARNING, logger="tandem"):
        assert torch.equal(wrapped(torch.ones(3)), torch.full((3,), 2.0))
        assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 2.0))
    warnings = [r for r in caplog.records if "running it eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "test forward" in warnings[0].getMessage()


@pytest.mark.parametrize("mode", [1, 2, "FAST", True])
def test_unknown_compilation_mode_is_named(tiny_checkpoints, mode):
    with pytest.raises(ConfigError, match="compilation_config.mode"):
        LLM(str(tiny_checkpoints("llama")), compilation_config={"mode": mode})
