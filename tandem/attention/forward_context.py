"""The scoped per-step context that attention layers read: metadata and the backend per kind.

`with forward_context(meta, backends): model(...)` — not nestable, so a stale context can never
leak into the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tandem.attention.backend import AttentionBackend
from tandem.attention.metadata import AttentionMetadata
from tandem.attention.sharded_kv import ShardedAttentionMetadata


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | ShardedAttentionMetadata
    backends: dict[str, type[AttentionBackend]]  # attention kind -> backend
    # new K/V of this rank -> the tensor whose rows attn_metadata.write_rows index (PCP all-gather)
    gather_kv: Callable[[torch.Tensor], torch.Tensor] = _identity

    @property
    def gathers_kv(self) -> bool:
        """False when gather_kv is the identity (one rank, or no PCP step): a layer hands its own K/V as they are."""
        return self.gather_kv is not _identity


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata | ShardedAttentionMetadata, backends: dict[str, type[AttentionBackend]],
                    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[None]:
    """gather_kv: the PCP all-gather of the layers' new K/V, or None (one rank: nothing to gather)."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("forward_context is not nestable")
    _CURRENT = ForwardContext(meta, backends, gather_kv or _identity)
    try:
        yield
    finally:
        _CURRENT = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside forward_context()")
    return _CURRENT
