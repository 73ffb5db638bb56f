"""What each rank's process used, read from /proc (Linux): CPU seconds (user + system) and peak RSS (VmHWM). The
ranks are this process at one rank, else the processes the multi-rank executor spawned."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def rank_pids(llm: Any) -> list[int]:
    """The pid of each rank of `llm`'s engine: its spawned rank processes, or this process at one rank."""
    procs = getattr(llm.engine.executor, "procs", None)  # MultiprocExecutor's; the in-process executor has none
    return [p.pid for p in procs] if procs else [os.getpid()]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (fields 14 and 15 of /proc/PID/stat, see proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """The high-water mark of process `pid`'s resident memory so far, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
