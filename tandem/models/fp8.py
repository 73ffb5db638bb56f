"""Block-FP8 checkpoints, the format DeepSeek-V3/R1 are released in: `X.weight` in float8 with `X.weight_scale_inv`,
one float32 multiplier per `weight_block_size` block. tandem dequantizes them at load into the compute dtype.

A weight [rows, cols] with block [bm, bn] has a scale grid [ceil(rows / bm), ceil(cols / bn)]: the last block
of a row or column may be partial (e.g. DeepSeek-V3's kv_a_proj_with_mqa has 576 rows, 4.5 blocks of 128).
Leading dims (stacked experts) are shared by weight and scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# safetensors' dtype names of the float8 formats a block-FP8 weight may be stored in
FP8_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
_SUPPORTED_ACTIVATION_SCHEMES = ("dynamic",)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockFp8Format:
    block: tuple[int, int]  # (rows, cols) of one scale block: config.json weight_block_size

    @staticmethod
    def from_hf_config(hf: Any) -> BlockFp8Format | None:
        """The format named by config.json `quantization_config`; None for an unquantized checkpoint."""
        quant = getattr(hf, "quantization_config", None)
        if quant is None:
            return None
        method = quant.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported: tandem loads 'fp8' "
                             "(block-quantized weights) or unquantized checkpoints")
        scheme = quant.get("activation_scheme", "dynamic")
        if scheme not in _SUPPORTED_ACTIVATION_SCHEMES:
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported: one of "
                             f"{', '.join(_SUPPORTED_ACTIVATION_SCHEMES)} (weights are dequantized at load)")
        block = quant.get("weight_block_size")
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size={block!r} is not supported: two positive "
                             "integers [rows, cols] (per-tensor FP8 is not supported)")
        return BlockFp8Format((block[0], block[1]))

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, rows, cols = weight_shape
        return (*lead, _ceil_div(rows, self.block[0]), _ceil_div(cols, self.block[1]))

    def check_scale(self, weight_name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
        if len(weight_shape) < 2:
            raise ValueError(f"checkpoint tensor {weight_name!r} has shape {weight_shape}: a block-FP8 weight "
                             "needs at least 2 dims")
        expected = self.scale_shape(weight_shape)
        if tuple(scale_shape) != expected:
            raise ValueError(f"checkpoint tensor {weight_name + SCALE_SUFFIX!r} has shape {tuple(scale_shape)}, "
                             f"but weight {weight_name!r} {tuple(weight_shape)} with weight_block_size "
                             f"{list(self.block)} needs {expected}")

    def scale_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The scale-grid rows/cols covering weight ranges [(start, stop), ...] (leading dims unchanged)."""
        *lead, (r0, r1), (c0, c1) = ranges
        (bm, bn) = self.block
        return [*lead, (r0 // bm, _ceil_div(r1, bm)), (c0 // bn, _ceil_div(c1, bn))]

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, row_start: int, col_start: int) -> torch.Tensor:
        """weight: [..., r, c] float8, the slice starting at (row_start, col_start) of the full weight;
        scale: [..., R, C] float32, the scale blocks `scale_ranges` gave for that slice -> float32 [..., r, c].

        Example, block 32: rows 48..96 of a 96-row weight (TP rank 1 of 2) cut block 1 in half; the scale rows
        are blocks 1..3, expanded to rows 32..96, of which rows 16.. (48 - 32) are this slice's."""
        (bm, bn), (r, c) = self.block, weight.shape[-2:]
        s = scale.float().repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
        s = s.narrow(-2, row_start % bm, r).narrow(-1, col_start % bn, c)
        return weight.float() * s
