"""The KV cache's storage dtype (`kv_cache_dtype`) and its saturating store.

A layer's new K/V are converted to the cache's dtype once, before the PCP all-gather (so the gather moves the stored
bytes) and before any backend sees them: `stored = saturate(x / scale)` in the storage dtype. Every read casts the
stored values to the compute dtype (`.to(q.dtype)`, or in the native kernel's registers) and never multiplies by the
scale: the layer folds the scales into the math around the backend instead (tandem/attention/layer.py), exactly,
because attention is linear in them:

    scores = q . (k_scale * k_stored) * scale = q . k_stored * (scale * k_scale)      -> softmax scale * k_scale
    out    = sum_s p_s (v_scale * v_stored)   = v_scale * sum_s p_s v_stored          -> output * v_scale

MLA stores one entry [kv_c | k_pe] per token that is both key and value (its first L channels): one scale covers
the entry (vLLM's MLA uses the layer's k_scale the same way), folded into the softmax scale and the output alike.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x (compute dtype) -> its stored form in `dtype`: x / scale, clamped to dtype's finite range first, because
    torch's casts do not saturate (float8_e5m2 turns 61440 into inf; bfloat16 rounds float32's largest values to inf).
    The identity when `dtype` is x's own and the scale 1 (kv_cache_dtype auto)."""
    if x.dtype == dtype and scale == 1.0:
        return x
    if scale != 1.0:
        x = x / scale
    bound = torch.finfo(dtype).max
    if bound < torch.finfo(x.dtype).max:
        x = x.clamp(-bound, bound)
    return x.to(dtype)


def store_rows(cache_flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache_flat[slots] = rows, rows already in the cache's dtype. The CPU has no float8 index_copy_: float8 rows
    are copied as their bytes, which is what they are."""
    if cache_flat.dtype in FP8_DTYPES:
        cache_flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        cache_flat.index_copy_(0, slots, rows)
