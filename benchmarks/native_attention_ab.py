"""The native paged-attention kernel of this tree against the same kernel at another commit, in one process: both
sources are built side by side under their own op namespaces and called in alternating order, so a machine whose
speed drifts between minutes slows both alike. The measurements behind docs/kernels.md's paged-attention A/B.

    python benchmarks/native_attention_ab.py REV [--threads 2] [--rounds 6]

Prints one line per (dtype, rows x queries x keys) case: microseconds per call (the median of the rounds, each over
30 layers' caches in turn, cold) before and after, their ratio, and whether the outputs are identical to the bit.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tandem.native import ISA_FLAGS

NATIVE = Path(__file__).resolve().parent.parent / "tandem" / "native"
LAYERS, BLOCK = 30, 16
# (queries' dtype, cache's dtype, rows, queries a row, keys a row): SmolLM2's heads (9 query / 3 KV heads x 64)
CASES = [(torch.bfloat16, torch.bfloat16, 32, 1, 80), (torch.bfloat16, torch.bfloat16, 32, 1, 512),
         (torch.bfloat16, torch.bfloat16, 1, 1, 2048), (torch.bfloat16, torch.bfloat16, 32, 64, 64),
         (torch.bfloat16, torch.bfloat16, 4, 4, 200), (torch.bfloat16, torch.float8_e4m3fn, 32, 1, 80),
         (torch.float32, torch.float32, 32, 1, 80), (torch.float32, torch.float32, 32, 1, 512),
         (torch.float32, torch.float32, 32, 64, 64)]


def build(name: str, source: str, folder: Path) -> object:
    """The kernel's source (vec16.h beside it) as its own extension, registered under torch.ops.<name>."""
    (folder / "vec16.h").write_text((NATIVE / "vec16.h").read_text())
    path = folder / f"{name}.cpp"
    path.write_text(source.replace("TORCH_LIBRARY(tandem_native", f"TORCH_LIBRARY({name}"))
    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    load(name=name, sources=[str(path)], extra_cflags=flags, extra_ldflags=["-lgomp"], is_python_module=False)
    return getattr(torch.ops, name).paged_attention


def inputs(dtype: torch.dtype, kv_dtype: torch.dtype, rows: int, nq: int, keys: int, hq: int = 9, hkv: int = 3,
           d: int = 64) -> tuple:
    """q [rows * nq, hq, d]; LAYERS caches [slots, hkv, d] behind one random block table; rows, positions, out, lse."""
    blocks = (keys + BLOCK - 1) // BLOCK
    slots = (rows * blocks + 1) * BLOCK
    ks = [torch.randn(slots, hkv, d).to(kv_dtype) for _ in range(LAYERS)]
    vs = [torch.randn(slots, hkv, d).to(kv_dtype) for _ in range(LAYERS)]
    table = (torch.randperm(rows * blocks) + 1).int().view(rows, blocks).contiguous()
    q = torch.randn(rows * nq, hq, d).to(dtype)
    row_table = torch.tensor([[i, i * nq, nq, keys, 0] for i in range(rows)], dtype=torch.int32)
    positions = torch.tensor([keys - nq + j for _ in range(rows) for j in range(nq)], dtype=torch.int64)
    return q, ks, vs, table, row_table, positions, torch.empty_like(q), torch.empty(rows * nq, hq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the commit whose tandem/native/paged_attention.cpp is 'before'")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    before_src = subprocess.run(["git", "show", f"{args.rev}:tandem/native/paged_attention.cpp"], check=True,
                                capture_output=True, text=True, cwd=NATIVE).stdout
    with tempfile.TemporaryDirectory() as tmp:
        ops = {"before": build("tandem_ab_before", before_src, Path(tmp)),
               "after": build("tandem_ab_after", (NATIVE / "paged_attention.cpp").read_text(), Path(tmp))}
    for dtype, kv_dtype, rows, nq, keys in CASES:
        q, ks, vs, table, row_table, positions, out, lse = inputs(dtype, kv_dtype, rows, nq, keys)
        times: dict[str, list[float]] = {"before": [], "after": []}
        results = {}
        for r in range(args.rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                start = time.perf_counter()
                for k, v in zip(ks, vs, strict=True):
                    ops[name](q, k, v, table, row_table, positions, BLOCK, q.shape[-1] ** -0.5, out, lse)
                times[name].append((time.perf_counter() - start) / LAYERS * 1e6)
                results[name] = (out.clone(), lse.clone())
        same = all(torch.equal(a, b) for a, b in zip(results["before"], results["after"], strict=True))
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        kv = str(kv_dtype).removeprefix("torch.")
        print(f"{str(dtype).removeprefix('torch.')} q, {kv} cache, {rows} x {nq} x {keys}: before {before:.1f} us, "
              f"after {after:.1f} us, after / before {after / before:.2f}, identical {same}", flush=True)


if __name__ == "__main__":
    main()
