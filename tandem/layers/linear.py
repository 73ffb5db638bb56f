"""Tensor-parallel linear layers; each parameter carries the `weight_loader` that shards it.

Column-parallel splits the output dimension over TP ranks, row-parallel the input dimension
(followed by an all-reduce). Merged/QKV variants load several checkpoint tensors into one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.distributed.groups import SINGLE, Group
from tandem.layers.cpu_gemm import linear


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def new_param(shape: tuple[int, ...], loader: Callable[..., None] | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader or default_weight_loader  # type: ignore[attr-defined]
    return p


def shard_tensor(loaded: torch.Tensor, dim: int, tp: Group) -> torch.Tensor:
    size = loaded.shape[dim] // tp.size
    return loaded.narrow(dim, tp.rank * size, size)


def _expect_shards(module: nn.Module, shards: set[object]) -> None:
    # The strict loader reports a fused parameter missing until every listed shard arrived.
    for p in module.parameters(recurse=False):
        p.expected_shards = shards  # type: ignore[attr-defined]


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = new_param((out_features, in_features))
        self.bias = new_param((out_features,)) if bias else None
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout of weight, set after loading (cpu_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP ranks; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: Group = SINGLE):
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {tp.size}")
        self.tp = tp
        self.weight = new_param((out_features // tp.size, in_features), self._load)
        self.bias = new_param((out_features // tp.size,), self._load) if bias else None
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout of weight, set after loading (cpu_gemm)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, shard_tensor(loaded, 0, self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate_proj + up_proj) fused into one matmul."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp: Group = SINGLE):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp)
        _expect_shards(self, set(range(len(output_sizes))))

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs the shard index of the checkpoint tensor")
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        size = self.output_sizes[shard_id] // self.tp.size
        default_weight_loader(param.data.narrow(0, offset, size), shard_tensor(loaded, 0, self.tp))


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj, v_proj in one matmul; heads split over TP (KV heads replicated if fewer)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: Group = SINGLE):
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor_parallel_size {tp.size}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        # KV heads are replicated when there are fewer of them than TP ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, out, bias, tp)
        _expect_shards(self, {"q", "k", "v"})

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size, rank = {"q": (0, q, self.tp.rank), "k": (q, kv, self.tp.rank // self.kv_replicas),
                              "v": (q + kv, kv, self.tp.rank // self.kv_replicas)}[shard_id or ""]
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over TP ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: Group = SINGLE,
                 reduce_results: bool = True):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {tp.size}")
        self.tp = tp
        self.reduce_results = reduce_results
        self.weight = new_param((out_features, in_features // tp.size), self._load)
        self.bias = new_param((out_features,)) if bias else None
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout of weight, set after loading (cpu_gemm)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, shard_tensor(loaded, 1, self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.packed_weight)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
