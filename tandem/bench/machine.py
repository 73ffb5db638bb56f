"""The machine a benchmark ran on, for its report: CPU model and vector ISA, cores, torch version and threads, load,
date; the last-level cache; and the GEMM (float32, bfloat16) and memory-stream rates that benchmarks set their figures
against."""

from __future__ import annotations

import datetime
import os
import re
import time
from pathlib import Path

import torch


def _cpuinfo(field: str) -> str | None:
    """The first `field : value` of /proc/cpuinfo (what lscpu reads), None off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or "unknown"


# the flags that decide which CPU kernels run (oneDNN's AMX/AVX-512 paths, bf16 dot products)
_ISA = re.compile(r"avx\w*|amx\w*|fma|f16c|sse4_2")


def isa_flags() -> list[str]:
    """lscpu's vector and matrix ISA flags of this CPU (AVX2, AVX-512 parts, AMX), sorted."""
    return sorted(f for f in (_cpuinfo("flags") or "").split() if _ISA.fullmatch(f))


# The four ISA levels that set a CPU's GEMM peak, each with the lscpu flag that shows it: AVX-512 foundation,
# bf16 dot products (vdpbf16ps) and AMX's bf16 tiles, which oneDNN's bfloat16 GEMM uses where present.
ISA_LEVELS = {"avx2": "avx2", "avx512": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_bf16"}


def isa_levels(flags: list[str]) -> list[str]:
    """Which of avx2, avx512, avx512_bf16, amx `flags` (isa_flags()) show, in that order."""
    return [level for level, flag in ISA_LEVELS.items() if flag in flags]


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes read "32768K"


def llc_bytes() -> int | None:
    """The last-level cache of CPU 0 (sysfs, as lscpu reads it), None where sysfs does not say."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        sizes.append(int(size[:-1]) * _SIZE_UNITS[size[-1]] if size[-1] in _SIZE_UNITS else int(size))
    return max(sizes, default=None)


def machine_info() -> dict[str, object]:
    # The 1-minute load at start (and, set by the caller, at the end) tells whether other work shared the cores.
    return {"cpu": cpu_model(), "isa": isa_flags(), "num_cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_1m_at_start": os.getloadavg()[0],
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def describe(info: dict[str, object]) -> str:
    isa = " ".join(info["isa"]) if isinstance(info.get("isa"), list) else ""  # type: ignore[arg-type]
    return (f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
            f"{info['date']}, 1-min load {info['load_avg_1m_at_start']:.2f}\nISA: {isa or 'unknown'}")


GEMM_N = 2048  # an [N x N] @ [N x N] product: large enough to reach the cores' GEMM rate
STREAM_MIB = 256  # the float32 tensor a memory-stream read sums: several times a server CPU's last-level cache


def gemm_flops_per_s(repeats: int = 3, n: int = GEMM_N, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an [n x n] @ [n x n] product in `dtype` on the current torch threads, best of `repeats`. bfloat16 on
    a CPU without bf16 dot products runs tandem's panel GEMM, which its bf16 linears run there: torch's bf16 matmul
    is a generic loop on such CPUs (minutes at n = 2048, and no limit of anything the engine runs)."""
    from tandem import native
    from tandem.layers import cpu_gemm

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    if dtype == torch.bfloat16 and cpu_gemm.bf16_on_panels():
        packed = native.panel_pack(b.T.contiguous())  # b^T as an [N, K] weight: a @ b = a b^T^T

        def product() -> torch.Tensor:
            return native.panel_linear(a, packed, n, None)
    else:
        def product() -> torch.Tensor:
            return a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def stream_bytes_per_s(repeats: int = 3, mib: int = STREAM_MIB) -> float:
    """Bytes/s of reading a `mib` MiB float32 tensor once (a sum), best of `repeats`: what a weight read can reach."""
    x = torch.randn(mib << 18)  # 4-byte elements
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def load_line(info: dict[str, object]) -> str:
    """The 1-minute load at start and end: whether other processes shared the cores during the run."""
    return f"1-min load: {info['load_avg_1m_at_start']:.2f} at start, {info['load_avg_1m_at_end']:.2f} at the end"
