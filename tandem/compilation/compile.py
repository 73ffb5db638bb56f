"""compilation_config.mode VLLM_COMPILE: the target's forward and each MTP layer's forward run through
torch.compile (inductor), split at the opaque ops of opaque_ops.py, which run eagerly between the compiled
pieces on the step's metadata.

One compile per callable covers every token count (the token axis is dynamic; torch specializes 1 on its own), so
warmup over the capture sizes compiles both and then only replays. On CPU inductor freezes the weights
(constant-folds them and prepacks the GEMM weights for oneDNN) and fuses the elementwise ops around the GEMMs.
A compile that fails falls back to the eager forward with one warning; the engine keeps running.
"""

from __future__ import annotations

import logging
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


class CompiledForward:
    """Calls the compiled function, or the eager one once compiling failed."""

    def __init__(self, eager: Callable[..., Any], what: str):
        self.eager, self.what = eager, what
        self.compiled: Callable[..., Any] | None = torch.compile(eager, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # a compile failure, not a runtime error
            logger.warning("compiling %s failed, running it eagerly: %s", self.what, str(e).splitlines()[0])
            self.compiled = None
            return self.eager(*args)


def compile_model(model: nn.Module, config: CompilationConfig) -> None:
    """Swap in compiled forwards for the target trunk and its MTP layers (in place; eager when mode is NONE)."""
    if not config.compiles:
        return
    _configure_inductor()
    model.forward = CompiledForward(model.forward, f"{type(model).__name__}.forward")  # type: ignore[method-assign]
    mtp = getattr(model, "mtp", None)
    for i, layer in enumerate(mtp.layers if mtp is not None else []):
        layer.forward = CompiledForward(layer.forward, f"MTP layer {i}")
