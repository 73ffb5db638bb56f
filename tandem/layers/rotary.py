"""Rotary position embedding: default, YaRN (as DeepSeek-V3 uses it) and llama3 scaling;
neox (halves) or interleaved (GPT-J pairs) layout; partial rotary over the first `rotary_dim` dims.

Reads both config spellings: `rope_theta` + `rope_scaling` (released checkpoints) and
`rope_parameters` (transformers >= 5).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem import native


def rope_params(hf: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with a "rope_type" key, {} for plain RoPE) from a config namespace."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = dict(getattr(hf, "rope_scaling", None) or params)
    theta = getattr(hf, "rope_theta", None) or params.get("rope_theta") or 10000.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), {}
    scaling["rope_type"] = kind
    return float(theta), scaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(scaling: dict[str, Any], base_scale: float) -> float:
    """DeepSeek-V3 multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
        return base_scale
    m = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return base_scale * m * m


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    kind = scaling.get("rope_type")
    if not kind:
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_position, pos_freqs)
    raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported: one of default, linear, llama3, yarn")


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_position: int,
                   pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / orig
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None,
                 interleaved: bool = False):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        inv_freq, attention_factor = _inv_freq(rotary_dim, theta, scaling or {}, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_position, rotary_dim // 2] each; kept float32, cast to the activations' dtype on use
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate the first `rotary_dim` dims of each x: [num_tokens, num_heads, head_dim]."""
        if all(native.serves_elementwise(x) and x.dim() == 3 for x in xs) and self.cos_cache.dtype == torch.float32:
            # one pass a tensor instead of the gathers, slices, muls and cats below (tandem/native)
            return tuple(native.rotary(x, positions, self.cos_cache, self.sin_cache, self.rotary_dim,
                                       self.interleaved) for x in xs)
        if self.interleaved and not torch.compiler.is_compiling() and all(_complex_view_ok(x, self.rotary_dim)
                                                                          for x in xs):
            # eager float32: each adjacent pair is one complex number, rotated by one complex multiply (one op
            # instead of ~14, the same bits: (x1 + i x2)(cos + i sin) is the formula below); inductor fuses the
            # real formula itself, and it has no complex kernels
            rot = torch.view_as_complex(torch.stack((self.cos_cache[positions], self.sin_cache[positions]), -1))
            rot = rot.unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2] complex64
            return tuple(torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)
                         for x in xs)
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2]
        sin = self.sin_cache[positions].unsqueeze(1)
        return tuple(self._rotate(x, cos.to(x.dtype), sin.to(x.dtype)) for x in xs)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out


def _complex_view_ok(x: torch.Tensor, rotary_dim: int) -> bool:
    """x (float32, the whole head rotated) can be seen as complex pairs in place: unit last stride, even others."""
    return (x.dtype == torch.float32 and x.shape[-1] == rotary_dim and x.stride(-1) == 1
            and x.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in x.stride()[:-1]))
