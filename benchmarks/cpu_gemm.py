"""F.linear vs the oneDNN-prepacked GEMM (tandem/layers/cpu_gemm.py) over weight shapes x row counts: the
measurements behind PACK_MIN_ELEMENTS and ANY_ROWS_ELEMENTS.

    python benchmarks/cpu_gemm.py [--threads 2] [--dtype float32] [--rows 1 2 4 8 16 32 128]

Prints one line per [N, K] weight (the bundled model's and SmolLM2-135M's projections by default): microseconds
per call, F.linear / packed, best of 3 rounds, one process, nothing else running.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.layers.cpu_gemm import DECODE_ROWS_HINT

SHAPES = [(128, 256), (576, 256), (256, 256), (1024, 256), (2048, 256),  # bundled DeepSeek-V3-shaped model
          (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M


def best_us(fn: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}; us per call, F.linear / packed")
    with torch.inference_mode():
        for n, k in SHAPES:
            w = torch.randn(n, k, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS_HINT)
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, k, dtype=dtype)
                calls = max(5, int(2e8 // (n * k * max(rows, 8))))
                plain = best_us(lambda x=x, w=w: F.linear(x, w), calls)
                ours = best_us(lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                               calls)
                cells.append(f"{rows}: {plain:.0f}/{ours:.0f}")
            print(f"[{n}, {k}]  " + "  ".join(cells))


if __name__ == "__main__":
    main()
