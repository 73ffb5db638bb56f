"""Keep freed activation memory in the process instead of handing it back to the kernel every step.

A CPU step allocates the same large activations every time (a 2,048-token prompt chunk's MLP output on SmolLM2 is
[2048, 3072] float32, 25 MB). glibc serves such blocks with mmap and unmaps them on free, or trims the heap top
back to the kernel, so the next step touches fresh pages again: one page fault per 4 KiB, each zeroing its page.
Measured here (AMD EPYC, 2 cores, SmolLM2 float32, 32 prompts, 2,053 prompt tokens): 2.16 M minor faults and
3.78-3.99 s for the prefill, 0.64 M faults and 3.09-3.31 s with the heap kept; 32 x 32 end to end 7.2-7.7 s ->
6.5-6.9 s. vLLM's CPU docs reach for the same thing by preloading tcmalloc; tandem asks glibc through mallopt.

The cost: the process keeps its peak working set of activations (not the KV cache, which is allocated once) while
its engine lives, as every serving engine's caching allocator does; an engine's shutdown hands it back
(`release_freed_memory`). Kept, it slowed whatever the process did next: on this VM (AMD EPYC, 2 cores) the ranks of
a PCP=2 engine started after a PCP=1 engine of the same process had prefilled 4,096 tokens spent 3.9 s in the kernel
instead of 0.3 s on as many page faults, and its prefill took 8.2-9.0 s instead of 4.8.

TANDEM_KEEP_HOST_MEMORY=0 leaves glibc's defaults, and a user's own MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ (glibc's environment tunables) win over this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from tandem import envs

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit: blocks above 32 MiB are still mapped per call
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest one stands for "never trim the heap top"

_applied: bool | None = None


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Ask glibc to serve blocks up to 32 MiB from the heap and never trim it; True where it took effect.
    Idempotent; a no-op off Linux/glibc, when disabled, or when the user set glibc's own tunables."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not envs.keep_host_memory() or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False  # the user tuned glibc themselves
    try:
        mallopt = _libc().mallopt  # type: ignore[union-attr]
    except AttributeError:  # no libc found, or musl or another libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; setting either also turns off glibc's dynamic mmap threshold
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim) where keep_freed_memory kept them: an
    engine's shutdown calls it, so a process that goes on does not sit on its activations. True where it ran."""
    if not _applied:
        return False
    trim = getattr(_libc(), "malloc_trim", None)
    return trim is not None and bool(trim(0))
