"""SwiGLU on a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem import native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    if native.serves_elementwise(gate_up):
        return native.silu_and_mul(gate_up)  # one pass, no gate / up temporaries (tandem/native)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
