"""F.linear vs the oneDNN-prepacked GEMM (tandem/layers/cpu_gemm.py) over weight shapes x row counts: the
measurements behind PACK_MIN_ELEMENTS and ANY_ROWS_ELEMENTS.

    python benchmarks/cpu_gemm.py [--threads 2] [--dtype float32] [--rows 1 2 4 8 16 32 128]
    python benchmarks/cpu_gemm.py --amx-sweep [--rows 5 8 16 32 48 64 128]
    python benchmarks/cpu_gemm.py --panels [--rows 1 2 4 8 32 128 1024]
    python benchmarks/cpu_gemm.py --panel-sweep [--rows 1 4 8 16 32 64 128 256 512 1400]

Prints one line per [N, K] weight (the bundled model's and SmolLM2-135M's projections by default): microseconds
per call, F.linear / packed, best of 3 rounds, one process, nothing else running.

--amx-sweep (a CPU with AMX-BF16): oneDNN's packed bf16 GEMM against tandem's AMX kernel (tandem/native/amx_gemm.cpp)
over a whole decode's projections twice (SmolLM2-135M's qkv, o, gate_up and down of 60 layers in turn, ~425 MB, past
a 300 MiB L3, so cold as a decode's), the two alternating, median of 7: one line per row count, ms a sweep and GB/s
(the measurements behind AMX_MAX_ROWS).

--panels: the panel GEMM (tandem/native/panel_gemm.cpp: what a CPU without bf16 dot products runs in bfloat16, and
one without avx512 in float32) in both dtypes beside float32 F.linear, oneDNN packed and the small-row kernel, and
bfloat16 F.linear and the small-row kernel's widening path, SmolLM2-135M's projections and LM head, warm:
microseconds per call, best of 3 rounds.

--panel-sweep (an avx2 CPU): float32 over a whole forward's projections (SmolLM2-135M's qkv, o, gate_up and down of
30 layers in turn, 425 MB, past the L3, so cold as a step's): F.linear, oneDNN packed and the panels, taking turns,
median of 3 rounds: GFLOP/s per row count (the measurements behind FP32_PANEL_MAX_ROWS).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from tandem import native
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


def amx_sweep(row_counts: list[int]) -> None:
    if not native.amx_available():
        raise SystemExit("--amx-sweep: this CPU has no AMX-BF16 (or the native kernels are not built)")
    shapes = SHAPES[5:9]  # SmolLM2-135M's qkv, o, gate_up, down
    weights = [(torch.randn(n, k) * k**-0.5).bfloat16() for _ in range(60) for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS_HINT) for w in weights]
    amx = [native.amx_pack(w) for w in weights]
    gb = sum(w.numel() * 2 for w in weights) / 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bfloat16, {gb * 1e3:.0f} MB of weights")
    with torch.inference_mode():
        for rows in row_counts:
            xs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
            calls = {"oneDNN": lambda w, p, v, xs=xs: torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None,
                                                                                        "none", [], ""),
                     "AMX kernel": lambda w, p, v, xs=xs: native.amx_linear(xs[w.shape[1]], v, None)}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for r in range(7):
                for name in list(calls)[:: 1 if r % 2 == 0 else -1]:
                    start = time.perf_counter()
                    for w, p, v in zip(weights, onednn, amx, strict=True):
                        calls[name](w, p, v)
                    times[name].append(time.perf_counter() - start)
            cells = [f"{name} {statistics.median(t) * 1e3:.2f} ms ({gb / statistics.median(t):.1f} GB/s)"
                     for name, t in times.items()]
            print(f"{rows} rows: " + ", ".join(cells), flush=True)


def panels(row_counts: list[int]) -> None:
    if not native.panels_available():
        raise SystemExit("--panels: the native kernels are not built for this CPU (x86 with avx2)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
          "; us per call: float32 F.linear | float32 packed | float32 small-row | float32 panels | bf16 F.linear | "
          "bf16 small-row | bf16 panels")
    with torch.inference_mode():
        for n, k in SHAPES[5:]:
            w = torch.randn(n, k) * k**-0.5
            w16 = w.bfloat16()
            packed, panel = torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS_HINT), native.panel_pack(w16)
            panel32 = native.panel_pack(w)
            for rows in row_counts:
                x = torch.randn(rows, k)
                x16 = x.bfloat16()
                calls = max(3, int(2e8 // (n * k * max(rows, 8))))
                fns = [partial(F.linear, x, w),
                       partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
                       partial(native.small_linear, x, w, None) if rows <= 8 else None,
                       partial(native.panel_linear, x, panel32, n, None),
                       partial(F.linear, x16, w16) if rows <= 128 else None,
                       partial(native.small_linear, x16, w16, None) if rows <= 4 else None,
                       partial(native.panel_linear, x16, panel, n, None)]
                cells = [best_us(fn, calls) if fn is not None else float("nan") for fn in fns]
                print(f"[{n}, {k}] {rows:5d} rows  " + " | ".join(f"{c:9.1f}" for c in cells), flush=True)


def panel_sweep(row_counts: list[int]) -> None:
    if not native.panels_available():
        raise SystemExit("--panel-sweep: the native kernels are not built for this CPU (x86 with avx2)")
    shapes = SHAPES[5:9] * 30  # SmolLM2-135M's qkv, o, gate_up, down, layer by layer
    weights = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS_HINT) for w in weights]
    panel = [native.panel_pack(w) for w in weights]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"float32, {sum(w.numel() * 4 for w in weights) / 1e6:.0f} MB of weights; GFLOP/s")
    with torch.inference_mode():
        for rows in row_counts:
            xs = {k: torch.randn(rows, k) for _, k in SHAPES[5:9]}
            calls = {"F.linear": lambda i, xs=xs: F.linear(xs[weights[i].shape[1]], weights[i]),
                     "oneDNN packed": lambda i, xs=xs: torch.ops.mkldnn._linear_pointwise(
                         xs[weights[i].shape[1]], onednn[i], None, "none", [], ""),
                     "panels": lambda i, xs=xs: native.panel_linear(xs[weights[i].shape[1]], panel[i],
                                                                    weights[i].shape[0], None)}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(3):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for i in range(len(weights)):
                        call(i)
                    times[name].append(time.perf_counter() - start)
            flops = sum(2 * rows * n * k for n, k in shapes)
            print(f"{rows} rows: " + ", ".join(f"{name} {flops / statistics.median(t) / 1e9:.1f}"
                                               for name, t in times.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--amx-sweep", action="store_true")
    parser.add_argument("--panels", action="store_true")
    parser.add_argument("--panel-sweep", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.panels:
        panels(args.rows or [1, 2, 4, 8, 32, 128, 1024])
        return
    if args.panel_sweep:
        panel_sweep(args.rows or [1, 4, 8, 16, 32, 64, 128, 256, 512, 1400])
        return
    if args.amx_sweep:
        amx_sweep(args.rows or [5, 8, 16, 32, 48, 64, 128])
        return
    args.rows = args.rows or [1, 2, 4, 8, 16, 32, 128]
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
