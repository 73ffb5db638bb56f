"""The engine keeps freed activation memory (tandem/worker/host_memory.py): a step's large activations reuse the
pages of the last step's instead of faulting fresh zeroed pages in; the user's own glibc settings and the opt-out
are respected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, torch
from tandem.worker.host_memory import keep_freed_memory
applied = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def layers():  # a 2,048-token prompt chunk's MLP activations on SmolLM2, four layers
    x = torch.empty(2048, 576).fill_(1.0)
    for _ in range(4):
        gate_up = torch.empty(2048, 3072).fill_(1.0)  # 25 MB
        h = torch.empty(2048, 1536).fill_(1.0)  # 12.6 MB
        del gate_up
        x = x + torch.empty(2048, 576).fill_(1.0)
        del h
layers()
before = faults()
for _ in range(5):
    layers()
print(applied, faults() - before)
"""


def _probe(**env: str) -> tuple[bool, int]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "TANDEM_KEEP"))} | env
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_freed_activations_are_reused_not_faulted_in_again() -> None:
    applied, kept = _probe()
    off, _ = _probe(TANDEM_KEEP_HOST_MEMORY="0")
    assert applied and not off
    # glibc's default is path-dependent (a dynamic mmap threshold; in the engine 2.16 M faults for a SmolLM2 prompt
    # chunk's prefill vs 0.64 M kept, host_memory.py's figures), so the test pins down the kept side: the heap serves
    # every later activation from pages it already has
    pages = 5 * 4 * (25 + 12) * 10**6 // 4096  # ~180 k: every large activation faulting its pages in
    assert kept < pages // 20, f"kept memory still faulted {kept} of {pages} pages"
    # the user's own glibc tunables win: keep_freed_memory leaves them alone
    user, _ = _probe(MALLOC_TRIM_THRESHOLD_="1000000")
    assert not user
