"""PIECEWISE graphs (tandem/compilation/piecewise.py) on the CPU, through a stand-in Graph that keeps the captured
callable and, on replay, re-runs it on the static input buffers only, writing its results into the captured output
tensors in place (a real capture runs nothing: its outputs are garbage until the first replay, which the stand-in
mimics by poisoning them). With it: replays equal the uncaptured piece at every capture size as inputs change, the
static buffers stay put, a replay never writes what the caller kept, other sizes run uncaptured, a failed capture
runs uncaptured with one warning, and engines with the graphs on give eager's greedy tokens."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from engine_utils import random_prompts
from torch import nn
from torch.utils._pytree import tree_leaves

import tandem.compilation.compile as compile_mod
from tandem import LLM, SamplingParams, native
from tandem.compilation import opaque_ops
from tandem.compilation.compile import CompiledForward
from tandem.compilation.piecewise import GraphRun, PieceGraphs

SIZES = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


class StandInGraph:
    """A CPU 'graph' with CUDAGraph's contract: capture returns outputs that hold nothing yet; replay recomputes
    from the captured arguments (the static buffers) as they are now and writes into those same outputs."""

    def warmup(self, fn: Any, args: list[Any]) -> Any:
        return fn(*args)

    def capture(self, fn: Any, args: list[Any]) -> Any:
        self.fn, self.args = fn, args
        self.outputs = fn(*args)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for out in tree_leaves(self.outputs):  # not one that aliases an input (a view of a weight, say)
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
                out.fill_(float("nan") if out.is_floating_point() else -7)
        return self.outputs

    def replay(self) -> None:
        for out, new in zip(tree_leaves(self.outputs), tree_leaves(self.fn(*self.args)), strict=True):
            if isinstance(out, torch.Tensor):
                out.copy_(new)


class FailingGraph(StandInGraph):
    def capture(self, fn: Any, args: list[Any]) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")


def _run(factory: Any = StandInGraph) -> GraphRun:
    return GraphRun("test forward", SIZES, factory)


def _affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ w + 1, x.sum(-1)


def _called(graphs: PieceGraphs, size: int, *args: Any) -> Any:
    graphs.run.num_tokens = size if size in graphs.run.capture_sizes else None
    try:
        return graphs(*args)
    finally:
        graphs.run.num_tokens = None


def test_replays_equal_the_uncaptured_piece_at_each_size_as_inputs_change():
    graphs = PieceGraphs(_affine, [False, True], _run())  # x changes every call, w sits still
    w = torch.randn(4, 3)
    for size in SIZES:
        for call in range(4):  # warm-up, capture (+ replay), replays
            x = torch.randn(size, 4)
            got, want = _called(graphs, size, x, w), _affine(x, w)
            for g, e in zip(got, want, strict=True):
                assert torch.allclose(g, e), f"size {size}, call {call}: max diff {(g - e).abs().max()}"
    assert graphs.run.num_captured == len(SIZES)


def test_static_buffers_and_outputs_stay_put_across_replays():
    graphs = PieceGraphs(_affine, [False, True], _run())
    w = torch.randn(4, 3)
    for _ in range(2):
        _called(graphs, 4, torch.randn(4, 4), w)
    entry = graphs.entries[4]
    buffer, outputs = entry.static_args[0].data_ptr(), [o.data_ptr() for o in entry.outputs]
    for _ in range(3):
        got = _called(graphs, 4, torch.randn(4, 4), w)
        assert [o.data_ptr() for o in got] == outputs, "a replay returns its static outputs"
        assert entry.static_args[0].data_ptr() == buffer, "the input is copied into the same static buffer"
        assert entry.static_args[1] is w, "a fixed input is read in place, not copied"


def test_a_moved_fixed_input_runs_uncaptured_rather_than_read_stale():
    graphs = PieceGraphs(_affine, [False, True], _run())
    x, w = torch.randn(2, 4), torch.randn(4, 3)
    for _ in range(2):
        _called(graphs, 2, x, w)
    other = torch.randn(4, 3)
    assert torch.allclose(_called(graphs, 2, x, other)[0], _affine(x, other)[0])


def test_failed_capture_runs_uncaptured_with_one_warning(caplog):
    graphs = PieceGraphs(_affine, [False, True], _run(FailingGraph))
    w = torch.randn(4, 3)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        for size in (4, 4, 4, 2, 2, 2):
            x = torch.randn(size, 4)
            assert torch.allclose(_called(graphs, size, x, w)[0], _affine(x, w)[0])
    warnings = [r.getMessage() for r in caplog.records if "running it uncaptured" in r.getMessage()]
    assert len(warnings) == 1 and "test forward" in warnings[0], warnings
    assert graphs.run.failed and graphs.run.num_captured == 0


class _Attention(nn.Module):
    """Stands in for an attention layer: the opaque op runs this eagerly between the compiled pieces."""

    def __init__(self):
        super().__init__()
        self.name = opaque_ops.register_layer(self)

    def forward_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q * k.sigmoid() + v


class _TwoLayers(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(hidden, 3 * hidden) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(2))
        self.attn = nn.ModuleList(_Attention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for qkv, out, attn in zip(self.qkv, self.out, self.attn, strict=True):
            q, k, v = qkv(x.relu()).chunk(3, dim=-1)
            if torch.compiler.is_compiling():
                a = torch.ops.tandem.attention(q.contiguous(), k.contiguous(), v.contiguous(), attn.name)
            else:
                a = attn.forward_eager(q, k, v)
            x = x + out(a)
        return x, x.mean(-1)


@pytest.fixture
def two_layers() -> tuple[_TwoLayers, CompiledForward]:
    model = _TwoLayers()
    return model, CompiledForward(model.forward, "two layers", _run())


def test_compiled_forward_replays_equal_eager_and_larger_sizes_run_uncaptured(two_layers):
    model, forward = two_layers
    with torch.inference_mode():
        for size in (*SIZES, 5, 16):  # 5: not a capture size; 16: above the largest
            for call in range(3):
                x = torch.randn(size, 16)
                got, want = forward(x), model(x)
                for g, e in zip(got, want, strict=True):
                    assert torch.allclose(g, e, atol=1e-5), f"size {size}, call {call}: {(g - e).abs().max()}"
    run = forward.graphs
    assert forward.lean and not run.failed
    assert run.num_captured == 3 * len(SIZES), "3 pieces around 2 attention calls, one graph each per capture size"
    assert run.num_replays == 2 * 3 * len(SIZES), "the 2nd and 3rd call at each capture size replay every piece"


def test_a_replay_does_not_overwrite_what_the_caller_kept(two_layers):
    model, forward = two_layers
    with torch.inference_mode():
        x1, x2 = torch.randn(2, 16), torch.randn(2, 16)
        x1_before = x1.clone()
        for _ in range(2):
            forward(x1)  # warm-up, capture
        kept = forward(x1)
        forward(x2)
        assert torch.allclose(kept[0], model(x1)[0], atol=1e-5), "the next replay wrote into a kept output"
        assert torch.equal(x1, x1_before), "the caller's input was written"


LENGTHS = [3, 11, 5]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GRAPHS = {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": list(SIZES)}


def _greedy(path: Any, device: str, **kwargs: Any) -> tuple[list[list[int]], list[tuple[GraphRun, int]]]:
    """Greedy tokens, and the graphs of each compiled forward (target, then MTP layers) with the piece replays the
    generate made."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS, vocab_size=500, seed=5)]
    if kwargs.get("compilation_config"):
        # a fresh Dynamo cache: the graphs earlier tests in this process compiled count toward its limits, past which
        # a decode step's frames run uncompiled (and replay no pieces)
        torch._dynamo.reset()
    llm = LLM(str(path), device=device, dtype="float32", max_num_batched_tokens=32, **kwargs)
    try:
        model = llm.engine.executor.runner.model
        mtp = getattr(model, "mtp", None)
        forwards = [model.forward, *(layer.forward for layer in (mtp.layers if mtp is not None else []))]
        runs = [f.graphs for f in forwards if getattr(f, "graphs", None) is not None]
        before = [run.num_replays for run in runs]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        return tokens, [(run, run.num_replays - b) for run, b in zip(runs, before, strict=True)]
    finally:
        llm.shutdown()


def _check_graphed(eager: list[list[int]], graphed: list[list[int]], runs: list[tuple[GraphRun, int]]) -> None:
    assert runs and not runs[0][0].failed, "the target forward compiled whole, with graphs"
    run, replays = runs[0]
    pieces = run.num_captured // len(SIZES)
    assert pieces > 1 and run.num_captured == pieces * len(SIZES), "warmup captured every piece at every size"
    # one prompt step of 19 tokens (uncaptured), then 7 decode steps of 3 rows padded to 4, each replaying every piece
    assert replays >= 7 * pieces, f"{replays} replays in the decode steps, {pieces} pieces"
    assert graphed == eager


def _on_cpu_with_stand_in_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU the small-row GEMM's check reads a ContextVar (the engine's native.Serving) that Dynamo cannot
    # trace: the forward would break, compile with its guards and drop its graphs. A CUDA tensor never reaches it.
    monkeypatch.setattr(native, "serves_gemm", lambda x, weight: False)
    monkeypatch.setattr(compile_mod, "_cpu_graph_factory", StandInGraph)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_engine_with_piecewise_graphs_matches_eager(tiny_checkpoints, monkeypatch, arch):
    path = tiny_checkpoints(arch)
    eager, _ = _greedy(path, "cpu")
    _on_cpu_with_stand_in_graphs(monkeypatch)
    _check_graphed(eager, *_greedy(path, "cpu", compilation_config=GRAPHS))


def test_mtp_drafting_through_piecewise_graphs_matches_eager(tiny_checkpoints, monkeypatch):
    """The MTP layer's pieces capture too, and its one-token draft decodes (padded to a capture size) replay them."""
    path = tiny_checkpoints("deepseek_v3", num_mtp_layers=1)
    eager, _ = _greedy(path, "cpu")
    _on_cpu_with_stand_in_graphs(monkeypatch)
    graphed, runs = _greedy(path, "cpu", compilation_config=GRAPHS,
                            speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert len(runs) == 2, "the target and the MTP layer each have graphs"
    mtp, replays = runs[1]
    assert not mtp.failed and mtp.num_captured > 0 and replays > 0, (mtp.num_captured, replays)
    assert graphed == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_cuda_graphs_match_eager(tiny_checkpoints, arch):
    path = tiny_checkpoints(arch)
    _check_graphed(_greedy(path, "cuda")[0], *_greedy(path, "cuda", compilation_config=GRAPHS))
