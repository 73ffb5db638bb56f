"""The scoped per-step context that attention layers read: the step's batch, the backend per kind, and the PCP
collectives the layers call.

`with forward_context(batch, backends): model(...)` — not nestable, so a stale context can never leak into the
next step. A layer asks for its backend's own metadata of the batch (`metadata(kind)`), built once per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tandem.attention.backend import AttentionBackend
from tandem.attention.batch import AttentionBatch
from tandem.attention.sharded_kv import ShardedKVExchange


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class ForwardContext:
    batch: AttentionBatch
    backends: dict[str, type[AttentionBackend]]  # attention kind -> backend
    # new K/V of this rank -> the tensor whose rows batch.write_rows index (PCP all-gather)
    gather_kv: Callable[[torch.Tensor], torch.Tensor] = _identity
    # sharded KV: the queries' gather and the partials' merge around the backend's sharded forward, else None
    kv_exchange: ShardedKVExchange | None = None

    @property
    def gathers_kv(self) -> bool:
        """False when gather_kv is the identity (one rank, or no PCP step): a layer hands its own K/V as they are."""
        return self.gather_kv is not _identity

    def metadata(self, kind: str) -> Any:
        """The metadata that the backend of `kind` built for this batch."""
        return self.batch.metadata_for(self.backends[kind])


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(batch: AttentionBatch, backends: dict[str, type[AttentionBackend]],
                    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    kv_exchange: ShardedKVExchange | None = None) -> Iterator[None]:
    """gather_kv: the PCP all-gather of the layers' new K/V, or None (one rank: nothing to gather); kv_exchange:
    the sharded KV layout's collectives (batch.kv_shard set), or None."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("forward_context is not nestable")
    _CURRENT = ForwardContext(batch, backends, gather_kv or _identity, kv_exchange)
    try:
        yield
    finally:
        _CURRENT = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside forward_context()")
    return _CURRENT
