"""The one interface every drafter implements (MTP, DSpark, n-gram, none), and what it reads of the target's step.

The model runner calls the same four hooks whatever the drafter is (DESIGN §4):
    kv_bytes_per_block / allocate_kv_cache   the drafter's own KV, sharing the target's block pool
    kv_layers()                              the attention layers owning that KV (fp8 scale calibration)
    warmup(step, k)                          one capture size, padding only
    observe(step)                            every step, right after the target forward (context writes)
    propose(step, emitted, k) -> Proposal    K drafts per sampling row for the next step
and `free(request_ids)` when requests finish, for drafters that keep per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from tandem.step_plan import StepPlan
from tandem.worker.input_batch import InputBatch
from tandem.worker.pcp_hooks import LocalBatch, PCPHooks


@dataclass
class TargetStep:
    """The target's step as a drafter sees it: the global batch, this rank's PCP view of it and the target's
    rank-local final-normed hidden states. Rows in global order cross PCP ranks only when asked for."""

    plan: StepPlan
    batch: InputBatch  # GLOBAL batch, identical on every rank
    local: LocalBatch  # this rank's PCP segments (the global batch itself at PCP size 1)
    hidden_local: torch.Tensor  # [T_r, H] padding rows zero
    pcp: PCPHooks
    _global_hidden: torch.Tensor | None = field(default=None, repr=False)

    def global_hidden(self) -> torch.Tensor:
        """[T_global(+padding), H] every token's hidden state in global order (one all-gather, then cached)."""
        if self._global_hidden is None:
            self._global_hidden = self.pcp.maybe_restore(self.hidden_local)
        return self._global_hidden

    def hidden_rows(self, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """[len(rows), H] the given global rows: from the restored states when a drafter already restored them,
        else only these rows cross ranks."""
        if self._global_hidden is not None:
            return self._global_hidden[rows]
        return self.pcp.maybe_restore_rows(self.hidden_local, rows)


@dataclass
class Proposal:
    draft_token_ids: list[list[int]] = field(default_factory=list)  # [S][K] per sampling row; [] when none
    draft_probs: list[torch.Tensor] | None = None  # S x [K, V] q of probabilistic drafts, else None
    stats: dict[str, float] = field(default_factory=dict)  # drafter-specific counters, summed by the engine


class Proposer(Protocol):
    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None: ...

    def kv_layers(self) -> list[nn.Module]: ...

    def warmup(self, step: TargetStep, k: int) -> None: ...

    def observe(self, step: TargetStep) -> None: ...

    def propose(self, step: TargetStep, emitted: list[list[int]], k: int) -> Proposal: ...

    def free(self, request_ids: list[str]) -> None: ...


class NoProposer:
    """Speculative decoding off: every hook does nothing."""

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None:
        pass

    def kv_layers(self) -> list[nn.Module]:
        return []

    def warmup(self, step: TargetStep, k: int) -> None:
        pass

    def observe(self, step: TargetStep) -> None:
        pass

    def propose(self, step: TargetStep, emitted: list[list[int]], k: int) -> Proposal:
        return Proposal()

    def free(self, request_ids: list[str]) -> None:
        pass
