"""The machine a benchmark ran on, for its report: CPU model, cores, torch version and threads, load, date."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict[str, object]:
    # The 1-minute load at start (and, set by the caller, at the end) tells whether other work shared the cores.
    return {"cpu": cpu_model(), "num_cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_1m_at_start": os.getloadavg()[0],
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def describe(info: dict[str, object]) -> str:
    return (f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
            f"{info['date']}, 1-min load {info['load_avg_1m_at_start']:.2f}")
