"""compilation_config.mode VLLM_COMPILE: the target's forward and each MTP layer's forward run through
torch.compile (inductor), split at the opaque ops of opaque_ops.py, which run eagerly between the compiled
pieces on the step's metadata.

One compile per callable covers every token count (the token axis is dynamic; torch specializes 1 on its own), so
warmup over the capture sizes compiles both and then only replays. On CPU inductor freezes the weights
(constant-folds them and prepacks the GEMM weights for oneDNN) and fuses the elementwise ops around the GEMMs.
A compile that fails falls back to the eager forward with one warning; the engine keeps running.

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

from tandem.config import CompilationConfig

logger = logging.getLogger("tandem")


def _configure_inductor() -> None:
    import torch._dynamo
    import torch._inductor.config as inductor

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


def _compile(eager: Callable[..., Any], graphs: bool) -> Callable[..., Any]:
    options: dict[str, Any] = {"guard_filter_fn": _kept_guards}
    if graphs:  # inductor captures the pieces between the opaque ops (graph partitions) as CUDA graphs
        import torch._inductor.config as inductor

        options |= {"triton.cudagraphs": True} | ({"graph_partition": True} if hasattr(inductor, "graph_partition")
                                                  else {})
    return torch.compile(own_code(eager), dynamic=True, fullgraph=True, options=options)


def _owned(out: Any) -> Any:
    """The tensors of a CUDA-graph replay's output, copied out of the graph's memory pool: the next replay of the same
    graph overwrites them, and the runner keeps hidden states across draft passes and steps."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)


class CompiledForward:
    """Calls the compiled function, or the eager one once compiling failed. With `graph_max_tokens` (CUDA with
    PIECEWISE padding), calls of at most that many tokens (the first argument's length: the padded capture sizes)
    replay CUDA graphs of the compiled pieces; larger ones run the same pieces uncaptured."""

    def __init__(self, eager: Callable[..., Any], what: str, graph_max_tokens: int = 0):
        self.eager, self.what = eager, what
        self.compiled: Callable[..., Any] | None = _compile(eager, graphs=False)
        self.graph_max_tokens = graph_max_tokens
        self.graphed: Callable[..., Any] | None = _compile(eager, graphs=True) if graph_max_tokens else None
        self.lean = True  # whole graphs with the structural guards dropped; False once it had to break

    def __call__(self, *args: Any) -> Any:
        if self.graphed is not None and args[0].shape[0] <= self.graph_max_tokens:
            try:
                # each call is its own generation of inductor's CUDA-graph trees: the outputs are copied out below,
                # so no earlier replay's outputs are live when this one overwrites them
                torch.compiler.cudagraph_mark_step_begin()
                return _owned(self.graphed(*args))
            except torch._dynamo.exc.TorchDynamoException as e:
                logger.warning("capturing %s as CUDA graphs failed, running it uncaptured: %s", self.what,
                               str(e).splitlines()[0])
                self.graphed = None
        if self.compiled is None:
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # a compile failure, not a runtime error
            if self.lean and isinstance(e, torch._dynamo.exc.Unsupported):  # cannot be captured whole
                logger.info("%s has a graph break (%s): compiling it with Dynamo's guards", self.what,
                            str(e).splitlines()[0])
                self.lean, self.compiled, self.graphed = False, torch.compile(self.eager, dynamic=True), None
                return self(*args)
            logger.warning("compiling %s failed, running it eagerly: %s", self.what, str(e).splitlines()[0])
            self.compiled = self.graphed = None
            return self.eager(*args)


def _graph_max_tokens(model: nn.Module, config: CompilationConfig) -> int:
    # CUDA graphs where PIECEWISE padding gives the steps a few sizes (CPUs have no graphs to replay)
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    return max(config.capture_sizes) if config.pads and on_cuda else 0


def compile_drafter(drafter: nn.Module, what: str, config: CompilationConfig) -> None:
    """Swap in a compiled forward for a drafter that is not part of the target (an EAGLE-3 head)."""
    if not config.compiles:
        return
    _configure_inductor()
    drafter.forward = CompiledForward(drafter.forward, what,  # type: ignore[method-assign]
                                      _graph_max_tokens(drafter, config))


def compile_model(model: nn.Module, config: CompilationConfig) -> None:
    """Swap in compiled forwards for the target trunk and its MTP layers (in place; eager when mode is NONE)."""
    if not config.compiles:
        return
    _configure_inductor()
    graph_max = _graph_max_tokens(model, config)
    model.forward = CompiledForward(model.forward, f"{type(model).__name__}.forward",  # type: ignore[method-assign]
                                    graph_max)
    mtp = getattr(model, "mtp", None)
    for i, layer in enumerate(mtp.layers if mtp is not None else []):
        layer.forward = CompiledForward(layer.forward, f"MTP layer {i}", graph_max)
