"""The machine a benchmark ran on, for its report: CPU model and vector ISA, cores, torch version and threads, load,
date."""

from __future__ import annotations

import datetime
import os
import re
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


def machine_info() -> dict[str, object]:
    # The 1-minute load at start (and, set by the caller, at the end) tells whether other work shared the cores.
    return {"cpu": cpu_model(), "isa": isa_flags(), "num_cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_1m_at_start": os.getloadavg()[0],
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def describe(info: dict[str, object]) -> str:
    isa = " ".join(info["isa"]) if isinstance(info.get("isa"), list) else ""  # type: ignore[arg-type]
    return (f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
            f"{info['date']}, 1-min load {info['load_avg_1m_at_start']:.2f}\nISA: {isa or 'unknown'}")
