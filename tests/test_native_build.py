"""The native kernels are built before anything is timed: by `python -m tandem.native` (the install step) or, at the
latest, while an engine starts; a build says so on one line before it begins."""

from __future__ import annotations

import subprocess
import sys

from tandem import LLM, native


def test_a_missing_library_needs_a_build_and_the_built_one_does_not():
    assert native.needs_build("tandem_native_never_built_here")
    result = subprocess.run([sys.executable, "-m", "tandem.native"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    if "ready" in result.stdout:  # a machine without a compiler keeps the PyTorch paths (and says so)
        assert not native.needs_build(native.build_name())
        again = subprocess.run([sys.executable, "-m", "tandem.native"], capture_output=True, text=True, timeout=300)
        assert "building" not in again.stderr, "a second run rebuilt the kernels"


def test_the_engine_loads_the_kernels_while_it_starts(tiny_checkpoints):
    native._state.pop("ok", None)  # as in a fresh process: nothing loaded yet
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32")
    try:
        assert "ok" in native._state, "the kernels were left to load inside the first generate"
    finally:
        llm.shutdown()
