"""compilation_config.mode VLLM_COMPILE: torch.compile'd pieces between the opaque attention / MoE / collective ops
give the same greedy tokens as eager on every tiny architecture, with PCP=2 and with MTP drafting; a compile
failure falls back to eager with one warning; bad modes are named; a forward compiled without its structural guards
stays its own instance's and still follows its inputs and the globals it reads."""

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


def test_engine_forward_compiles_whole_with_the_native_kernels(tiny_checkpoints, native_kernels):
    """The target forward is captured whole (no graph break, so Dynamo keeps only the input guards) with the native
    kernels serving it: their per-engine switch is read as a constant of the trace, not a graph break."""
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", compilation_config={"mode": "VLLM_COMPILE", **SIZES})
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)
        assert llm.engine.executor.runner.model.forward.lean
    finally:
        llm.shutdown()


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


_SWITCH = {"double": False}  # a module-level switch the forward reads, as tandem.native's kernel switch


class _Scale(torch.nn.Module):
    def __init__(self, k: float, graph_break: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), k), requires_grad=False)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph_break and x.sum() > 0:  # data-dependent branch: Dynamo cannot capture it whole
            x = x + 0
        y = x * self.w
        return y * 2 if _SWITCH["double"] else y


@pytest.mark.parametrize("rows", [None, 1, 3])
def test_lean_forward_is_its_instances_own(rows):
    """Two models of one class, compiled without the guards on their structure and parameters: each runs its own
    weights, not the first one's frozen graph. Two things keep them apart: each forward compiles from its own copy
    of the code object (compile.own_code), and Dynamo skips a cache entry made by another torch.compile call (its
    backend check); the test fails only if neither holds, e.g. a single shared compile with the filter."""
    a, b = _Scale(2.0), _Scale(3.0)
    fa, fb = CompiledForward(a.forward, "a"), CompiledForward(b.forward, "b")
    x = torch.ones(4) if rows is None else torch.ones(rows, 4)
    with torch.inference_mode():
        assert torch.equal(fa(x), x * 2) and torch.equal(fb(x), x * 3)
        assert torch.equal(fa(x), x * 2)
    assert fa.lean and fb.lean


def test_lean_forward_follows_its_inputs_and_globals():
    """The guards kept are the ones that change between calls: a new dtype or rank of the input, and a global the
    forward reads (the native kernels' switch), each take a fresh graph rather than a stale one."""
    f = CompiledForward(_Scale(2.0).forward, "scale")
    with torch.inference_mode():
        assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))
        got = f(torch.ones(4, dtype=torch.float64))
        assert got.dtype == torch.float64 and torch.equal(got, torch.full((4,), 2.0, dtype=torch.float64))
        assert torch.equal(f(torch.ones(2, 4)), torch.full((2, 4), 2.0))
        _SWITCH["double"] = True
        try:
            assert torch.equal(f(torch.ones(4)), torch.full((4,), 4.0))
        finally:
            _SWITCH["double"] = False
        assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))


def test_forward_with_a_graph_break_compiles_with_its_guards(caplog):
    model = _Scale(5.0, graph_break=True)
    f = CompiledForward(model.forward, "breaking forward")
    with caplog.at_level(logging.INFO, logger="tandem"), torch.inference_mode():
        assert torch.equal(f(torch.ones(4)), torch.full((4,), 5.0))
        assert torch.equal(f(-torch.ones(3, 4)), torch.full((3, 4), -5.0))
    assert not f.lean and f.compiled is not None
    assert any("graph break" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", [1, 2, "FAST", True])
def test_unknown_compilation_mode_is_named(tiny_checkpoints, mode):
    with pytest.raises(ConfigError, match="compilation_config.mode"):
        LLM(str(tiny_checkpoints("llama")), compilation_config={"mode": mode})


def test_opaque_ops_stay_outside_cuda_graphs():
    """The piecewise backend (piecewise.py) cuts the compiled graph at ops tagged cudagraph_unsafe and captures only
    the pieces between: attention, the MoE experts and the collectives read this step's metadata, which a graph would
    freeze."""
    import tandem.compilation.opaque_ops  # noqa: F401 - registers the ops

    for op in (torch.ops.tandem.attention, torch.ops.tandem.mla_attention, torch.ops.tandem.moe_experts,
               torch.ops.tandem.all_reduce):
        assert torch._C.Tag.cudagraph_unsafe in op.default.tags, op


def test_cuda_graphs_only_on_cuda_with_padding(tiny_checkpoints):
    """A CPU engine's compiled forward replays no graphs (a CPU has none to replay), with padding or without."""
    llm = LLM(str(tiny_checkpoints("llama")), **ENGINE,
              compilation_config={"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", **SIZES})
    try:
        forward = llm.engine.executor.runner.model.forward
        assert isinstance(forward, CompiledForward)
        assert forward.graphs is None
    finally:
        llm.shutdown()


def test_graph_outputs_are_copied_out():
    """A replay's outputs live in the graph's pool and the next replay overwrites them: the caller gets copies."""
    from tandem.compilation.compile import _owned

    logits, hidden = torch.ones(2, 3), torch.zeros(2, 3)
    got = _owned((logits, hidden))
    assert isinstance(got, tuple) and torch.equal(got[0], logits) and torch.equal(got[1], hidden)
    assert got[0].data_ptr() != logits.data_ptr() and got[1].data_ptr() != hidden.data_ptr()
