"""Custom ops that torch.compile treats as opaque calls: the split points of vLLM's PIECEWISE compilation.

attention     reads and writes the paged KV cache through the step's forward context (metadata shapes change
              every step, and under PCP it all-gathers the new K/V): never traced, always eager.
moe_experts   the routed experts loop over the experts that received tokens (data-dependent sizes, and the
              expert-parallel collectives).
all_reduce    a TP all-reduce (gloo/NCCL collectives are not traceable); out of place, as custom ops must be.

Each op is tagged cudagraph_unsafe: on CUDA the piecewise backend (piecewise.py) cuts the compiled graph at them and
captures only the pieces between as CUDA graphs (their Python reads this step's metadata, which a graph would freeze).

Each op names its layer (or group) by a registered string, since ops take tensors and plain values only. Layers
call the op only while being compiled (`torch.compiler.is_compiling()`); eagerly they run their own code, with no
dispatcher overhead.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist

_LAYERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_GROUPS: dict[str, dist.ProcessGroup] = {}
_ids = itertools.count()
# run between CUDA graphs, never inside one (tags: torch >= 2.8 has cudagraph_unsafe)
_TAGS = tuple(t for t in (getattr(torch._C.Tag, "cudagraph_unsafe", None),) if t is not None)


def register_layer(module: Any) -> str:
    """A unique name under which the opaque ops find `module` (held weakly: a freed model leaves nothing)."""
    name = f"{type(module).__name__}.{next(_ids)}"
    _LAYERS[name] = module
    return name


def group_name(group: dist.ProcessGroup) -> str:
    name = f"pg.{id(group)}"
    _GROUPS[name] = group
    return name


@torch.library.custom_op("tandem::attention", mutates_args=(), tags=_TAGS)
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: str) -> torch.Tensor:
    """GQA: q [T, Hq * D], k / v [T, Hkv * D] -> [T, Hq * D] (tandem.attention.layer.Attention)."""
    return _LAYERS[layer].forward_eager(q, k, v)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: str) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("tandem::mla_attention", mutates_args=(), tags=_TAGS)
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  kv_b_weight: torch.Tensor, layer: str) -> torch.Tensor:
    """MLA: q_nope [T, H, nope], q_pe [T, H, rope], kv_c [T, L], k_pe [T, rope] -> [T, H * v]."""
    return _LAYERS[layer].forward_eager(q_nope, q_pe, kv_c, k_pe, kv_b_weight)


@mla_attention.register_fake
def _(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
      layer: str) -> torch.Tensor:
    module = _LAYERS[layer]
    return q_nope.new_empty(q_nope.shape[0], module.num_heads * module.v_dim)


@torch.library.custom_op("tandem::moe_experts", mutates_args=(), tags=_TAGS)
def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: str) -> torch.Tensor:
    """x [T, H], topk_weights [T, K] float32, topk_ids [T, K] -> [T, H] (tandem.layers.moe.FusedMoE)."""
    return _LAYERS[layer].forward_eager(x, topk_weights, topk_ids)


@moe_experts.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tandem::all_reduce", mutates_args=(), tags=_TAGS)
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_GROUPS[group])
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)
