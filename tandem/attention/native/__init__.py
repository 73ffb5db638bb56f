"""tandem's one native CPU kernel: paged attention for short rows (decodes, verification rows), reading keys and
values in place through the block table (paged_attention.cpp).

Plain PyTorch ops cannot read a paged cache in place: the fallback gathers every row's keys and values into a
padded copy a layer (index_select), builds a mask, and calls SDPA, whose CPU kernel pays ~5 us of fixed work per
(row, KV head) at decode sizes. vLLM's CPU backend has its own paged kernels for the same reason.

The kernel is compiled once per machine with torch's C++ extension builder (the C++ compiler and ninja that
inductor's CPU code generation needs too), cached under torch's extensions folder, and loaded on first use. Where
it cannot be built (no compiler) the engine keeps the PyTorch path and says so once. `TANDEM_NATIVE_ATTENTION=0`
turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger("tandem")

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
ISA_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
             "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]}
_lock = threading.Lock()
_state: dict[str, bool] = {}


# Model dtypes the kernel serves. bfloat16 keeps the PyTorch path: its matmuls round the scores and probabilities to
# bf16 as Hugging Face's bf16 attention does, and the kernel's float32 scores part ways with those roundings; on the
# tiny random MoE checkpoints a 1-ulp difference flips a router's top-k and moves the greedy tokens far off
# (tests/test_bf16_parity.py). The kernel itself computes bf16 caches correctly (tests/test_native_attention.py).
NATIVE_DTYPES = (torch.float32,)
_model: dict[str, torch.dtype] = {"dtype": torch.float32}


def use_for(dtype: torch.dtype) -> None:
    """The model runner's dtype: the kernel serves it when it is one of NATIVE_DTYPES."""
    _model["dtype"] = dtype


def enabled() -> bool:
    """True when the kernel serves this process's model: its dtype is one of NATIVE_DTYPES and the kernel is built
    and loaded (built on the first call)."""
    if _model["dtype"] not in NATIVE_DTYPES:
        return False
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return _state["ok"]


def set_enabled(on: bool) -> None:
    """Turn the kernel off (or back on, where it loads): tests and the A/B benchmark compare both paths."""
    _state["ok"] = on and _load()


def _load() -> bool:
    if os.environ.get("TANDEM_NATIVE_ATTENTION", "1") == "0":
        return False
    if hasattr(torch.ops.tandem_native, "paged_attention"):
        return True
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability()
        # the instruction set torch itself dispatches to here, named in the build's name: a build cached by one
        # kind of CPU is never loaded by another
        flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(capability, [])]
        load(name=f"tandem_native_paged_attention_{capability.lower()}", sources=[str(_SOURCE)], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a build error: the PyTorch path serves
        log.warning("tandem: the native CPU paged-attention kernel could not be built (%s: %s); attention uses "
                    "the PyTorch path", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
    return hasattr(torch.ops.tandem_native, "paged_attention")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                    rows: torch.Tensor, positions: torch.Tensor, block_size: int, scale: float, out: torch.Tensor,
                    lse: torch.Tensor) -> None:
    """q: [T, Hq, Dk]; k: [slots, Hkv, Dk]; v: [slots, Hkv, Dv]; block_table: [B, max_blocks] int32;
    rows: [R, 5] int32 (table row, first token, queries, seq_len, first key position); positions: [T] int64.
    Writes out [T, Hq, Dv] and lse [T, Hq] (float32) at the rows' query tokens."""
    torch.ops.tandem_native.paged_attention(q, k, v, block_table, rows, positions, block_size, scale, out, lse)
