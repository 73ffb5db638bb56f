"""Attention modules that models instantiate; the backend and metadata come from the forward context.

Each module owns its paged KV cache tensor (`kv_cache`, bound by the model runner after
allocation) and declares `kind` and `kv_spec()` so the runner can size and allocate it. The cache's dtype is
`kv_cache_dtype`'s: new K/V are stored in it (saturated, divided by the layer's `k_scale` / `v_scale`) before the PCP
gather, and the scales are folded into the softmax scale and the output (tandem/attention/kv_dtype.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.attention import kv_scales
from tandem.attention.expanded_prefix import KeptExpansion
from tandem.attention.forward_context import get_forward_context
from tandem.attention.kv_dtype import to_cache
from tandem.attention.mla import MLAUpProjection
from tandem.compilation import opaque_ops


class Attention(nn.Module):
    """GQA/MHA: q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""

    kind = "full_attention"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv_cache = torch.empty(0)
        # stored K = K / k_scale, V = V / v_scale (a checkpoint's k_scale / v_scale, else 1.0: vLLM's default)
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_scale_calibration: kv_scales.ReduceMax | None = None  # armed: scales from the next written batch
        self.layer_name = opaque_ops.register_layer(self)

    def kv_spec(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a split point: the compiled pieces end and resume around it
            return torch.ops.tandem.attention(q, k, v, self.layer_name)
        return self.forward_eager(q, k, v)

    def forward_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        t = q.shape[0]
        if self.kv_scale_calibration is not None:
            scales = kv_scales.calibrated(ctx, torch.cat((k, v), dim=-1), [k.shape[-1], v.shape[-1]],
                                          [kv_scales.K_SCALE_CONSTANT, kv_scales.V_SCALE_CONSTANT],
                                          self.kv_scale_calibration)
            if scales is not None:
                (self.k_scale, self.v_scale), self.kv_scale_calibration = scales, None
        k, v = to_cache(k, self.kv_cache.dtype, self.k_scale), to_cache(v, self.kv_cache.dtype, self.v_scale)
        scale = self.scale * self.k_scale
        if ctx.gathers_kv:  # one gather for K and V: under PCP every rank writes every rank's prefill K/V
            kv = ctx.gather_kv(torch.cat((k, v), dim=-1)).view(-1, 2, self.num_kv_heads, self.head_dim)
            k, v = kv[:, 0], kv[:, 1]
        else:
            k, v = k.reshape(t, self.num_kv_heads, self.head_dim), v.reshape(t, self.num_kv_heads, self.head_dim)
        meta, backend, exchange = ctx.metadata(self.kind), ctx.backends[self.kind], ctx.kv_exchange
        q = q.view(t, self.num_heads, self.head_dim)
        if exchange is not None:  # owner-sharded KV: every rank's queries over its own keys, partials merged by LSE
            o, lse = backend.forward_sharded(exchange.gather_queries(q), k, v, self.kv_cache, meta, scale)
            out = exchange.merge(o, lse).to(q.dtype)
        else:
            out = backend.forward(q, k, v, self.kv_cache, meta, scale)
        if self.v_scale != 1.0:
            out = out * self.v_scale
        return out.reshape(t, self.num_heads * self.head_dim)


class MLAAttention(nn.Module):
    """Multi-head latent attention over a latent cache.

    The cache holds only the normed latent kv_c and the rotated k_pe. Decodes run absorbed: scores
    q_nope.(W_UK kv_c) + q_pe.k_pe are computed as (q_nope W_UK).kv_c + q_pe.k_pe (MQA over 576-wide keys),
    the latent output is up-projected by W_UV. Prompt chunks run expanded (MHA over nope + rope wide heads)
    when the backend supports it, as vLLM's MLA prefill does: for Q queries over S keys that is
    (nope + rope + v) instead of (2 L + rope) multiply-adds per score, about 6x less at L = 512.
    `kv_b_weight` is kv_b_proj's weight [H * (nope + v), L] (this rank's heads).
    """

    kind = "mla_attention"

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim, self.scale = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale
        self.kv_cache = torch.empty(0)  # (with kept_prefix: a shared prefix's expansion, kept across steps)
        # stored entry = [kv_c | k_pe] / k_scale: one scale for the entry, which is both key and value (v_scale,
        # read with it, is unused: vLLM's MLA backends read k_scale alone)
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_scale_calibration: kv_scales.ReduceMax | None = None  # armed: the scale from the next written batch
        self.layer_name = opaque_ops.register_layer(self)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor) -> None:
        self._kv_cache = cache
        self.kept_prefix = KeptExpansion()  # an expansion of the old cache's latents says nothing of the new one's

    def kv_spec(self) -> tuple[int, int]:
        return self.kv_lora_rank, self.rope_dim

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor) -> torch.Tensor:
        # q_nope: [T, H, nope]; q_pe: [T, H, rope]; kv_c: [T, L] (normed); k_pe: [T, rope] (rotated) -> [T, H * v]
        if torch.compiler.is_compiling():  # a split point, as Attention's
            return torch.ops.tandem.mla_attention(q_nope, q_pe, kv_c, k_pe, kv_b_weight, self.layer_name)
        return self.forward_eager(q_nope, q_pe, kv_c, k_pe, kv_b_weight)

    def forward_eager(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                      kv_b_weight: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        w = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        up = MLAUpProjection(w_uk=w[:, : self.nope_dim], w_uv=w[:, self.nope_dim:],  # [H, nope, L], [H, v, L]
                             w_kv_b=kv_b_weight, kept=self.kept_prefix)
        entries = torch.cat((kv_c, k_pe), dim=-1)  # [T, L + rope]
        if self.kv_scale_calibration is not None:
            scales = kv_scales.calibrated(ctx, entries, [entries.shape[-1]], [kv_scales.K_SCALE_CONSTANT],
                                          self.kv_scale_calibration)
            if scales is not None:
                (self.k_scale,), self.kv_scale_calibration = scales, None
        entries = to_cache(entries, self.kv_cache.dtype, self.k_scale)
        entries = ctx.gather_kv(entries)  # [T (or P * max_local under PCP), L + rope]
        meta, backend, exchange = ctx.metadata(self.kind), ctx.backends[self.kind], ctx.kv_exchange
        scale = self.scale * self.k_scale
        if exchange is not None:  # owner-sharded KV: every rank's queries over its own latents, merged by LSE
            q = exchange.gather_queries(torch.cat((q_nope, q_pe), dim=-1))  # [T_global, H, nope + rope]
            o, lse = backend.forward_mla_sharded(q, entries, self.kv_cache, meta, scale, up)
            out = exchange.merge(o, lse).to(q_nope.dtype)
        else:
            out = backend.forward_mla(q_nope, q_pe, entries, self.kv_cache, meta, scale, up)  # [T, H, v]
        if self.k_scale != 1.0:
            out = out * self.k_scale
        return out.reshape(q_nope.shape[0], self.num_heads * self.v_dim)
