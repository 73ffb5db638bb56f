"""compilation_config.mode VLLM_COMPILE: the target's forward and each MTP layer's forward run through
torch.compile (inductor), split at the opaque ops of opaque_ops.py, which run eagerly between the compiled
pieces on the step's metadata.

The token axis is dynamic: a callable compiles once per range of token counts its code branches on (a target with
the native small-row GEMM: 1, 2-4 and 5 or more; torch specializes 1 on its own), so warmup over the capture sizes
compiles each and then only replays. On CPU inductor freezes the weights
(constant-folds them and prepacks the GEMM weights for oneDNN) and fuses the elementwise ops around the GEMMs.
On CUDA with PIECEWISE padding the piecewise backend (piecewise.py) compiles the pieces instead and replays each as
a CUDA graph per capture size. A compile that fails falls back to the eager forward with one warning, a capture
that fails to the uncaptured pieces; the engine keeps running.

Guards: Dynamo checks ~1,500 guards before every call of a compiled forward (that each submodule still has empty
hook dicts, the same type, the same parameters...): ~0.2 ms a call here, 4-5% of a batch-1 decode step. A model's
structure does not change once it is loaded, so each forward is compiled whole (fullgraph) and keeps only the
guards that can change between calls: the inputs' shapes and dtypes, torch's global state and the module globals
it read (the native-kernel switches). vLLM drops its guards for the same reason. Each forward compiles from its own
copy of the code object, where Dynamo keeps the compiled entries: another model of the same class (tests build
many) neither walks nor could match this one's. A forward that cannot be captured whole is compiled the guarded
way, graph breaks and all.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem import native
from tandem.compilation.piecewise import CudaGraph, GraphFactory, GraphRun, PiecewiseBackend
from tandem.config import CompilationConfig

logger = logging.getLogger("tandem")


def _configure_inductor() -> None:
    import torch._dynamo
    import torch._inductor.config as inductor

    native.prepare_for_tracing()  # the kernels' on/off switch, a constant of each compiled graph
    inductor.freezing = True  # weights are constants at inference: fold and prepack them
    # each engine in a process (tests build many) compiles its own model instances
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)


def _kept_guards(entries: Any) -> list[bool]:
    """Keep the guards on the call's inputs and on globals; drop those on the model's own structure (names rooted
    at the forward's `self`: its submodules, their hooks, types and parameters), which is fixed once it is loaded,
    and Dynamo's pairwise no-aliasing checks among the globals it read (modules, not tensors). A function without a
    `self` keeps every guard."""
    return [not e.name.startswith(("self.", "L['self']")) and not (e.is_global and e.guard_type == "DUPLICATE_INPUT")
            for e in entries]


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The same function (or method, bound to the same object) over a copy of its code object."""
    func = getattr(fn, "__func__", fn)
    code = func.__code__.replace()  # a new code object: Dynamo's cache entries attach to it alone
    own = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    owner = getattr(fn, "__self__", None)
    return own if owner is None else types.MethodType(own, owner)


def _compile(eager: Callable[..., Any], backend: Any = "inductor") -> Callable[..., Any]:
    return torch.compile(own_code(eager), backend=backend, dynamic=True, fullgraph=True,
                         options={"guard_filter_fn": _kept_guards})


def mark_tensor_attributes_static(module: nn.Module) -> None:
    """Fix the shapes of the tensors the modules hold as plain attributes (packed weights and the regions they are
    views of, KV caches, rotary tables) in the graphs compiled from them. Dynamo fixes parameters' and buffers'
    shapes on its own, but with `dynamic=True` it gave each of these symbolic sizes: ~200 symbols for a two-layer
    model, and inductor, comparing strides, equated the token count with one of them, so the first compile came
    out specialized to its token count (32) and was compiled again for every other size: 4 compiles of the target
    where 3 serve, each slower for the symbols."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                torch._dynamo.mark_static(value)
                if value._base is not None:
                    torch._dynamo.mark_static(value._base)


def _owned(out: Any) -> Any:
    """The tensors of a graph replay's output, copied out of the graphs' memory: the next replay of the same
    pieces overwrites them, and the runner keeps hidden states across draft passes and steps."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)


class CompiledForward:
    """Calls the compiled function, or the eager one once compiling failed. With `graphs` (CUDA with PIECEWISE
    padding), the pieces between the opaque ops replay as one graph each per capture size (piecewise.py) in calls
    whose token count (the first argument's length) is a capture size; other calls run the same pieces
    uncaptured."""

    def __init__(self, eager: Callable[..., Any], what: str, graphs: GraphRun | None = None,
                 module: nn.Module | None = None):
        self.eager, self.what, self.graphs, self.module = eager, what, graphs, module
        self.compiled: Callable[..., Any] | None = _compile(eager, "inductor" if graphs is None
                                                            else PiecewiseBackend(graphs))
        self.lean = True  # whole graphs with the structural guards dropped; False once it had to break

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        if self.module is not None:  # at the first call: the KV cache and the packed weights are in place by then
            mark_tensor_attributes_static(self.module)
            self.module = None
        try:
            return self._run(args)
        except torch._dynamo.exc.TorchDynamoException as e:  # a compile failure, not a runtime error
            if self.lean and isinstance(e, torch._dynamo.exc.Unsupported):  # cannot be captured whole
                logger.info("%s has a graph break (%s): compiling it with Dynamo's guards", self.what,
                            str(e).splitlines()[0])
                self.lean, self.compiled, self.graphs = False, torch.compile(self.eager, dynamic=True), None
                return self(*args)
            logger.warning("compiling %s failed, running it eagerly: %s", self.what, str(e).splitlines()[0])
            self.compiled = None
            return self.eager(*args)

    def _run(self, args: tuple[Any, ...]) -> Any:
        assert self.compiled is not None
        graphs, num_tokens = self.graphs, args[0].shape[0]
        if graphs is None or num_tokens not in graphs.capture_sizes:
            return self.compiled(*args)
        graphs.num_tokens = num_tokens  # the pieces replay this size's graphs
        try:
            return _owned(self.compiled(*graphs.static_inputs(args)))
        finally:
            graphs.num_tokens = None


# tests run the graphed path on the CPU with a stand-in Graph (a CPU has no graphs to replay)
_cpu_graph_factory: GraphFactory | None = None


def _compiled(eager: Callable[..., Any], module: nn.Module, what: str, config: CompilationConfig) -> CompiledForward:
    """The compiled forward, with graphs where PIECEWISE padding gives the steps a few sizes."""
    on_cuda = any(p.device.type == "cuda" for p in module.parameters())
    factory = CudaGraph if on_cuda else _cpu_graph_factory
    return CompiledForward(eager, what, GraphRun(what, config.capture_sizes, factory)
                           if config.pads and factory is not None else None, module)


def warmup_passes(model: nn.Module) -> int:
    """How many times the runner's warmup runs each capture size: twice where the target's compiled pieces replay
    graphs (the first call at a size warms up, the second captures), else once."""
    forward = model.forward
    return 2 if isinstance(forward, CompiledForward) and forward.graphs is not None else 1


def compile_drafter(drafter: nn.Module, what: str, config: CompilationConfig) -> None:
    """Swap in a compiled forward for a drafter that is not part of the target (an EAGLE-3 head)."""
    if not config.compiles:
        return
    _configure_inductor()
    drafter.forward = _compiled(drafter.forward, drafter, what, config)  # type: ignore[method-assign]


def compile_model(model: nn.Module, config: CompilationConfig) -> None:
    """Swap in compiled forwards for the target trunk and its MTP layers (in place; eager when mode is NONE)."""
    if not config.compiles:
        return
    _configure_inductor()
    model.forward = _compiled(model.forward, model, f"{type(model).__name__}.forward",  # type: ignore[method-assign]
                              config)
    mtp = getattr(model, "mtp", None)
    for i, layer in enumerate(mtp.layers if mtp is not None else []):
        layer.forward = _compiled(layer.forward, layer, f"MTP layer {i}", config)
