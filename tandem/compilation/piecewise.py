"""vLLM's PIECEWISE CUDA graphs: a torch.compile backend that cuts Dynamo's graph at the opaque ops (attention, MoE
experts, collectives: they run eagerly on the step's metadata), compiles each piece between them with inductor and
replays each compiled piece as one graph per capture size through a thin wrapper (`PieceGraphs`).

What a graph reads must sit at the same address at every replay:
  forward arguments  copied by the compiled forward into static buffers of its own, one set per size and shapes
                     (vLLM's persistent input buffers), before the call: read in place
  weights            parameters and buffers Dynamo lifted from the model: read in place
  chained            outputs of an earlier compiled piece, replayed into the same memory every call: read in place
  opaque outputs     fresh tensors every step: copied into the piece's own static buffer, made when it is captured
A replay checks that what it reads in place has not moved (else that call runs uncaptured), and writes only its
static outputs in the graph pool; the compiled forward hands its caller copies of those (compile.py `_owned`), so
nothing a caller holds is written by a later replay. A tensor a compiled forward leaves behind other than its return
value (a forward hook's kept output: LayerCapture) is pool memory, valid until the next compiled forward runs.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import fx

logger = logging.getLogger("tandem")


class Graph(Protocol):
    """One captured piece at one size (torch.cuda.CUDAGraph on CUDA; tests inject a CPU stand-in)."""

    def warmup(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """`fn(*args)`, run where the capture will run (lazy set-up, autotuning), before it."""

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Record `fn(*args)`; return its outputs, whose values are only valid after a `replay`."""

    def replay(self) -> None:
        """Run the recorded work again: it reads `args` as they are now and rewrites the outputs in place."""


GraphFactory = Callable[[], Graph]


@functools.cache
def _graph_pool() -> Any:
    # one pool for every piece of every forward (vLLM's global graph pool): the pieces of a call replay in the order
    # they were captured and no two calls overlap, so a piece's scratch memory may be another's
    return torch.cuda.graph_pool_handle()


@functools.cache
def _side_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # a capture cannot run on the legacy default stream


@contextmanager
def _on_side_stream() -> Iterator[None]:
    """Work on the side stream, ordered after and before the current stream's (torch.cuda.graph's protocol)."""
    stream = _side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


class CudaGraph:
    """A torch.cuda.CUDAGraph in the shared pool, warmed up and captured on a side stream. Captured by hand rather
    than through `torch.cuda.graph`, which runs gc.collect() and empty_cache() before each capture: seconds over
    the hundreds of pieces x sizes."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def warmup(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        with _on_side_stream():  # cuBLAS's workspace for the stream, Triton's autotuning: outside the capture
            return fn(*args)

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        with _on_side_stream():
            self.graph.capture_begin(pool=_graph_pool())
            try:
                return fn(*args)
            finally:
                self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class GraphRun:
    """One compiled forward's graphs: how they are made, and what the forward tells its pieces about the call
    running now (vLLM's forward-context batch descriptor): the token count whose graphs replay, or None to run
    uncaptured."""

    what: str
    capture_sizes: tuple[int, ...]
    graph_factory: GraphFactory
    num_tokens: int | None = None
    failed: bool = False  # a capture failed: every piece runs uncaptured from then on
    num_captured: int = 0  # graphs captured (pieces x sizes)
    num_replays: int = 0
    inputs: dict[tuple[Any, ...], list[torch.Tensor | None]] = field(default_factory=dict)

    def static_inputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The call's tensor arguments copied into the static buffers for their shapes and dtypes."""
        key = tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else None for a in args)
        buffers = self.inputs.get(key)
        if buffers is None:
            buffers = self.inputs[key] = [_like(a) if isinstance(a, torch.Tensor) else None for a in args]
        return tuple(a if b is None else b.copy_(a) for a, b in zip(args, buffers, strict=True))

    def fail(self, error: Exception) -> None:
        logger.warning("capturing %s as CUDA graphs failed, running it uncaptured: %s", self.what,
                       (str(error).splitlines() or [type(error).__name__])[0])
        self.failed = True


def _like(a: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)  # the piece asserts strides


@dataclass
class _Entry:
    """One piece at one size: warmed up, then captured."""

    graph: Graph
    captured: bool = False
    static_args: list[Any] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)  # opaque outputs: copied into static_args[i] when they moved
    in_place: list[int] = field(default_factory=list)  # the rest: the graph reads these tensors themselves
    outputs: Any = None


@dataclass
class PieceGraphs:
    """One compiled piece and its graphs, one per capture size: at each size the first call warms up, the next
    captures (and replays, so its outputs hold values) and later ones copy their moved inputs in and replay.
    Calls at other sizes, or once a capture failed, run the piece uncaptured."""

    piece: Callable[..., Any]
    fixed: list[bool]  # per argument: read in place, else an opaque output (copied)
    run: GraphRun
    entries: dict[int, _Entry] = field(default_factory=dict)

    def __call__(self, *args: Any) -> Any:
        size = self.run.num_tokens
        if size is None or self.run.failed:
            return self.piece(*args)
        entry = self.entries.get(size)
        try:
            if entry is None:
                entry = self.entries[size] = _Entry(self.run.graph_factory())
                return entry.graph.warmup(self.piece, args)
            if not entry.captured:
                self._capture(entry, args)
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves the engine running, uncaptured
            self.run.fail(e)
            return self.piece(*args)
        if any(args[i].data_ptr() != entry.static_args[i].data_ptr() for i in entry.in_place):
            return self.piece(*args)  # the graph would read memory that is no longer the argument
        for i in entry.copied:
            if args[i].data_ptr() != entry.static_args[i].data_ptr():
                entry.static_args[i].copy_(args[i])
        entry.graph.replay()
        self.run.num_replays += 1
        return entry.outputs

    def _capture(self, entry: _Entry, args: tuple[Any, ...]) -> None:
        entry.copied = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not self.fixed[i]]
        entry.in_place = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and self.fixed[i]]
        entry.static_args = list(args)
        for i in entry.copied:
            entry.static_args[i] = _like(args[i]).copy_(args[i])
        entry.outputs = entry.graph.capture(self.piece, entry.static_args)
        entry.captured = True
        self.run.num_captured += 1


def _is_opaque(node: fx.Node) -> bool:
    """A call of an op tagged cudagraph_unsafe (opaque_ops.py): the split points, run eagerly."""
    target = getattr(node.target, "default", node.target)  # Dynamo records the packet, the tags are the overload's
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        torch._C.Tag.cudagraph_unsafe in target.tags


def split_at_opaque_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Dynamo's graph as a graph of submodules `submod_<i>`: each opaque op alone in one, the nodes between two
    opaque ops in another, in the original order (vLLM's split_graph)."""
    piece, ids = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_opaque(node):
            ids[node] = piece + 1
            piece += 2
        else:
            ids[node] = piece
    return torch.fx.passes.split_module.split_module(gm, None, lambda n: ids[n], keep_original_order=True)


def _fixed_args(call: fx.Node, compiled: set[str]) -> list[bool]:
    """Per argument of a piece's call: False for an output of an opaque op, True for what sits still (the forward's
    arguments in their static buffers, weights, outputs of compiled pieces)."""
    def opaque_output(arg: Any) -> bool:
        if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is operator.getitem:
            arg = arg.args[0]  # one output of a submodule
        return isinstance(arg, fx.Node) and arg.op == "call_module" and arg.target not in compiled

    return [not opaque_output(a) for a in call.args]


class PiecewiseBackend:
    """A torch.compile backend: split at the opaque ops, compile each other piece with inductor (no freezing: the
    weights stay inputs, read in place by the graphs) and wrap it in PieceGraphs. Dynamo calls it once per graph
    it traces (the dynamic one, and the one it specializes for a single token)."""

    def __init__(self, run: GraphRun):
        self.run = run

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dispatch.python import enable_python_dispatcher
        from torch._guards import detect_fake_mode

        split = split_at_opaque_ops(gm)
        calls = [n for n in split.graph.nodes if n.op == "call_module"]
        compiled = {n.target for n in calls
                    if not any(_is_opaque(m) for m in split.get_submodule(n.target).graph.nodes)}
        fixed = {n.target: _fixed_args(n, compiled) for n in calls}
        backend = self

        fake_mode = detect_fake_mode(example_inputs)

        class CompilePieces(fx.Interpreter):
            """Runs the split graph on fake inputs, compiling each piece on its fake arguments (their symbolic
            token count makes one compile cover every size)."""

            def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
                value = super().get_attr(target, args, kwargs)  # a weight Dynamo installed for inductor's freezing
                return fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

            def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
                out = super().call_module(target, args, kwargs)
                if target in compiled:
                    from torch._inductor.compile_fx import compile_fx

                    piece = compile_fx(self.fetch_attr(target), list(args), config_patches={"freezing": False})
                    split.__dict__[target] = PieceGraphs(piece, fixed[target], backend.run)
                return out

        fake = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        with fake_mode, enable_python_dispatcher():
            CompilePieces(split).run(*fake)
        return split.forward
