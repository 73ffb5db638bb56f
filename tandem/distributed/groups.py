"""Process-group handles passed to layers; every collective here is a no-op at size 1.

Layers never look up ranks globally: they receive a `Group` (rank, size, torch ProcessGroup).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tandem.attention.kv_dtype import FP8_DTYPES
from tandem.compilation import opaque_ops


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    name: str = field(default="", compare=False)  # how the compiled model's all_reduce op finds `group`

    def __post_init__(self) -> None:
        if self.group is not None:
            object.__setattr__(self, "name", opaque_ops.group_name(self.group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if torch.compiler.is_compiling():  # collectives are opaque to the compiler (a split point)
            return torch.ops.tandem.all_reduce(x, self.name)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise MAX over the group, in place (eager only: the KV scale calibration's one reduce)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (all ranks pass the same shape)."""
        if self.size == 1:
            return x
        if x.dtype in FP8_DTYPES:  # gloo has no float8: a stored KV cache value crosses as its byte
            return self.all_gather(x.view(torch.uint8), dim).view(x.dtype)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        """Rank r sends rows [sum(send_rows[:s]), + send_rows[s]) of `x` to rank s and receives recv_rows[s] rows
        from each rank s, concatenated in rank order (every rank knows every size: they come from the plan)."""
        if self.size == 1:
            return x
        if x.dtype in FP8_DTYPES:
            return self.all_to_all(x.view(torch.uint8), send_rows, recv_rows).view(x.dtype)
        out = x.new_empty(sum(recv_rows), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_rows, input_split_sizes=send_rows,
                               group=self.group)
        return out


SINGLE = Group()


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank belongs to; world = TP x PCP with TP fastest."""

    tp: Group = SINGLE
    pcp: Group = SINGLE
    ep: Group = SINGLE


SINGLE_RANK = ParallelGroups()
