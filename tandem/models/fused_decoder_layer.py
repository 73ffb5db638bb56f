"""Llama-family decoder layers as one native call each, for steps whose every row is short (decodes, verification).

Why: a batch-1 decode of SmolLM2-135M streams ~0.6 ms of weights a layer, and the module path makes ~40
Python-level calls around that (norms, slices, rotary, the attention layer's metadata lookups, the K/V write, the
kernel, the linears' routing), each a Python frame and a dispatch: ~10 ms of a ~30 ms step, with the memory bus
idle. tandem/native/decoder_layer.cpp runs the layer's kernels in the module path's order on the same tensors, so
its output is the module path's, bit for bit (tests/test_fused_decoder_layer.py); this module says when it serves
and lays out its arguments, the per-step ones once a step and the per-layer ones once per row count.

It serves an eager step where: the native kernels serve the model's dtype; the step's attention metadata is the
PAGED_SDPA backend's with every row on the native kernel (no shared prefix, no prompt rows, no PCP gather, no
sharded KV) and its K/V rows written in order; and every layer is a plain LlamaDecoderLayer (Llama, or Qwen3 with its
per-head q/k norms; one TP rank) or an EAGLE-3 head's layer (whose qkv input, its embedded tokens' norm beside its
hidden state's, the caller passes in), whose cache holds the model's dtype with unit K/V scales and no calibration
armed, and whose linears all run on native kernels at this row count (tandem/layers/cpu_gemm.native_route).
Anything else takes the module path, which stays the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn.modules import module as nn_module

from tandem import native
from tandem.attention import forward_context
from tandem.attention.backends.prefix import kernel_positions, write_rows_leading
from tandem.attention.metadata import AttentionMetadata
from tandem.layers.cpu_gemm import native_route

if TYPE_CHECKING:
    from tandem.models.eagle3 import Eagle3DecoderLayer
    from tandem.models.llama import LlamaDecoderLayer

MAX_CACHED_ROW_COUNTS = 16  # row counts a layer keeps arguments for (a batch's decodes and verifications)
enabled = True  # tests and benchmarks compare against the module path by turning it off


def layer_step(layers: Sequence[torch.nn.Module], x: torch.Tensor, positions: torch.Tensor) -> Callable | None:
    """For this step (x: [T, H] the embedded tokens, positions: [T]): a function (layer, hidden[, attn_input]) -> the
    layer's output through the native call, or None where the module path must run (the module docstring says when).
    attn_input: qkv's input where it is not the input norm of hidden (EAGLE-3's layer)."""
    if not enabled or torch.compiler.is_compiling() or x.dim() != 2 or positions.dtype != torch.int64 \
            or not native.serves_elementwise(x):
        return None
    ctx = forward_context._CURRENT
    if ctx is None or ctx.gathers_kv or ctx.kv_exchange is not None:
        return None
    backend = ctx.backends.get("full_attention")
    if backend is None or backend.name != "PAGED_SDPA":
        return None
    meta = ctx.metadata("full_attention")
    if not isinstance(meta, AttentionMetadata) or meta.native_rows is None or meta.groups or meta.row_keys \
            or meta.long_rows or meta.native_long_rows is not None or meta.shared_prefix is not None:
        return None
    t = x.shape[0]
    if meta.write_rows.numel():
        leading = write_rows_leading(meta)
        if leading is None or leading > t:
            return None
        write_slots = meta.write_slots
    else:
        write_slots = meta.write_slots.new_empty(0)
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks \
            or any(layer._forward_pre_hooks or layer._forward_hooks_with_kwargs for layer in layers):
        return None  # (plain forward hooks run after each call, as module __call__ runs them)
    args = [_layer_args(layer, x) for layer in layers]
    if any(a is None for a in args):
        return None
    by_layer = dict(zip(map(id, layers), args, strict=True))
    step_args = (write_slots, meta.block_table, meta.native_rows, kernel_positions(meta, t))

    def run(layer: LlamaDecoderLayer | Eagle3DecoderLayer, hidden: torch.Tensor,
            attn_input: torch.Tensor | None = None, *, hooks: bool = True) -> torch.Tensor:
        # hooks: False where the call runs inside the layer's own forward (EAGLE-3's), whose __call__ runs them
        a = by_layer[id(layer)]
        assert a is not None
        out = native.gqa_decoder_layer(hidden, positions, *a[:13], a[13].kv_cache, *step_args, a[13].scale,
                                       attn_input)
        if not hooks:
            return out
        for hook in layer._forward_hooks.values():  # what module __call__ would run (EAGLE-3's aux layer captures)
            result = hook(layer, (positions, hidden), out)
            out = out if result is None else result
        return out

    return run


def _layer_args(layer: LlamaDecoderLayer | Eagle3DecoderLayer, x: torch.Tensor) -> tuple | None:
    """The layer's arguments of the native call at x's row count, its attention module last (whose kv_cache the call
    reads at each step: a cached reference would keep a replaced cache alive), or None where it does not serve.
    Cached on the layer per row count (a drafting step alternates a verification's rows with the head's one-row
    passes), rebuilt when a weight's layout or the cache's dtype changes."""
    by_rows = layer.__dict__.setdefault("_fused_args", {})
    cached = by_rows.get(x.shape[0])
    if cached is not None:  # (the check reads plain attributes only: nn.Module's submodule lookups cost ~1 us each)
        key, core, projections, tensors, args = cached
        if _plain_cache(core) and key == _cache_key(x, core) \
                and all(p.packed_weight is w for p, w in zip(projections, tensors, strict=True)):
            return args
    attn, mlp = layer.self_attn, layer.mlp
    core = attn.attn
    if not _plain_cache(core):  # (may change per step)
        return None
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    tensors = tuple(p.packed_weight for p in projections)
    args = _build_args(layer, x, projections)
    if len(by_rows) >= MAX_CACHED_ROW_COUNTS:
        by_rows.clear()
    by_rows[x.shape[0]] = (_cache_key(x, core), core, projections, tensors, args)
    return args


def _plain_cache(core: torch.nn.Module) -> bool:
    """The layer's cache holds unscaled K/V with no calibration armed (what the native call writes)."""
    return core.kv_scale_calibration is None and core.k_scale == 1.0 and core.v_scale == 1.0


def _cache_key(x: torch.Tensor, core: torch.nn.Module) -> tuple:
    return x.dtype, core.kv_cache.dtype, core.kv_cache.dim()


def _build_args(layer: LlamaDecoderLayer | Eagle3DecoderLayer, x: torch.Tensor, projections: tuple) -> tuple | None:
    from tandem.models.eagle3 import Eagle3DecoderLayer  # (the models import this module)
    from tandem.models.llama import LlamaDecoderLayer

    attn, mlp = layer.self_attn, layer.mlp
    core = attn.attn
    head_norms = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    if head_norms and (len(head_norms) != 2 or any(n.eps != layer.input_layernorm.eps or n.weight.dtype != x.dtype
                                                   for n in head_norms)):
        return None
    if type(layer) not in (LlamaDecoderLayer, Eagle3DecoderLayer) or core.kv_cache.dtype != x.dtype \
            or core.kv_cache.dim() != 5 \
            or attn.o_proj.tp.size != 1 or mlp.down_proj.tp.size != 1 \
            or attn.rotary_emb.cos_cache.dtype != torch.float32 \
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps \
            or not native.serves_elementwise(x, layer.input_layernorm.weight, layer.post_attention_layernorm.weight) \
            or layer.input_layernorm.weight.dtype != x.dtype \
            or layer.post_attention_layernorm.weight.dtype != x.dtype:
        return None
    widths = [p.weight.shape[1] for p in projections]  # (EAGLE-3's qkv reads 2H)
    kinds, weights = [], []
    for proj, width in zip(projections, widths, strict=True):
        # (a stand-in of the projection's input: its rows, width and dtype are what the route depends on)
        route = native_route(x.new_empty(x.shape[0], width), proj.weight, proj.packed_weight)
        if route is None:
            return None
        kinds.append(route[0])
        weights.append(route[1])
    rotary = attn.rotary_emb
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *(n.weight for n in head_norms)]
    sizes = [p.weight.shape[0] for p in projections]
    biases = [p.bias for p in projections]
    return (norms, layer.input_layernorm.eps, weights, kinds, sizes, biases, rotary.cos_cache, rotary.sin_cache,
            rotary.rotary_dim, rotary.interleaved, attn.num_heads, attn.num_kv_heads, attn.head_dim, core)
