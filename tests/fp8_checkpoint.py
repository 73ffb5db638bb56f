"""Block-FP8 copies of test checkpoints, quantized the way DeepSeek-V3's release is: every projection weight
(attention, dense/shared/routed experts, MTP eh_proj and block) in float8_e4m3fn with a float32
`weight_scale_inv` per block; embeddings, LM heads, norms and the router stay in the checkpoint dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def is_quantized_weight(name: str) -> bool:
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [rows, cols] -> (float8_e4m3fn [rows, cols], float32 scale [ceil(rows/bm), ceil(cols/bn)]);
    dequantized = fp8 * scale repeated over each block (the last block of a row or column may be partial)."""
    (bm, bn), (rows, cols) = block, weight.shape
    grid = (-(-rows // bm), -(-cols // bn))
    padded = torch.zeros(grid[0] * bm, grid[1] * bn)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], bm, grid[1], bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [R, C]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(grid[0] * bm, grid[1] * bn)[:rows, :cols].contiguous(), scale


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * s


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with its projection weights block-FP8 quantized; returns the dequantized
    value of every tensor (what a correct loader must end up with)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    out, expected = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            if is_quantized_weight(name):
                q, scale = quantize_block_fp8(t, block)
                out[name], out[name + "_scale_inv"] = q, scale
                expected[name] = dequantize_block_fp8(q, scale, block)
            else:
                out[name] = expected[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return expected
