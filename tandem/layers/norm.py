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
        if native.serves_elementwise(x, self.weight) and self.weight.dtype == x.dtype:
            return native.rms_norm(x, self.weight, self.eps)  # one pass instead of six ops (tandem/native)
        # torch's fused kernel computes HF's x * rsqrt(mean(x^2) + eps) in float32 (the same bits, one op
        # instead of five); the weight multiplies after the cast back, as HF does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden] -> (the norm of residual + x, residual + x): a pre-norm block's residual add and
        the norm after it, one pass over the rows where the native kernel serves (the same bits as the two ops)."""
        if x.dim() == 2 and native.serves_elementwise(x, residual, self.weight) \
                and self.weight.dtype == x.dtype == residual.dtype:
            return native.add_rms_norm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self.forward(summed), summed
