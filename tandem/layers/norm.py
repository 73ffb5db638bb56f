"""RMSNorm computed in float32 and cast back, as Hugging Face does (so logits match to 1e-5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem import native
from tandem.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.serves(x, self.weight) and self.weight.dtype == torch.float32:
            return native.rms_norm(x, self.weight, self.eps)  # one pass instead of six ops (tandem/native)
        # torch's fused kernel computes HF's x * rsqrt(mean(x^2) + eps) in float32 (the same bits, one op
        # instead of five); the weight multiplies after the cast back, as HF does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
