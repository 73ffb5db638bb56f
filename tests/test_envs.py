"""tandem/envs.py is the one place TANDEM_* variables are read: no other module reads one from os.environ, every
declared variable is documented in docs/usage.md, and a malformed value is an error naming the variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tandem import envs
from tandem.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _environ_reads(path: Path) -> list[str]:
    """TANDEM_* names read through os.environ / os.getenv in one file (string constants in those calls)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                found += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.append(node.slice.value)
    return [name for name in found if name.startswith("TANDEM_")]


def test_no_module_but_envs_reads_a_tandem_variable():
    offenders = {str(p.relative_to(REPO)): names for p in (REPO / "tandem").rglob("*.py")
                 if p.name != "envs.py" and (names := _environ_reads(p))}
    assert not offenders, f"read TANDEM_* through tandem.envs instead: {offenders}"


def test_every_variable_is_documented_and_every_documented_one_declared():
    usage = (REPO / "docs" / "usage.md").read_text()
    documented = set(re.findall(r"`(TANDEM_[A-Z_]+)`", usage))
    assert set(envs.VARIABLES) <= documented, set(envs.VARIABLES) - documented
    assert documented <= set(envs.VARIABLES), documented - set(envs.VARIABLES)


@pytest.mark.parametrize("name, value, call", [
    ("TANDEM_COLLECTIVE_TIMEOUT_S", "soon", envs.collective_timeout_s),
    ("TANDEM_COLLECTIVE_TIMEOUT_S", "-1", envs.collective_timeout_s),
    ("TANDEM_STEP_TIMEOUT_S", "0", envs.step_timeout_s),
    ("TANDEM_STEP_TIMEOUT_S", "inf", envs.step_timeout_s),
    ("TANDEM_NATIVE_KERNELS", "off", envs.native_kernels),
    ("TANDEM_KEEP_HOST_MEMORY", "yes", envs.keep_host_memory),
    ("TANDEM_HUGE_PAGES", "2", envs.huge_pages),
    ("TANDEM_DSPARK_CONTEXT_KV", "both", lambda: envs.dspark_context_kv(("sharded", "replicated"))),
])
def test_a_malformed_value_names_the_variable(monkeypatch, name, value, call):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}='{re.escape(value)}' is not allowed"):
        call()


def test_values_and_defaults(monkeypatch, tmp_path):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.collective_timeout_s() == 30.0 and envs.step_timeout_s() == 60.0
    assert envs.native_kernels() and envs.keep_host_memory() and envs.api_key() is None
    assert envs.dspark_context_kv(("sharded", "replicated")) == "sharded"
    monkeypatch.setenv("TANDEM_COLLECTIVE_TIMEOUT_S", "5")
    assert envs.step_timeout_s() == 10.0, "the step deadline defaults to twice the collective timeout"
    monkeypatch.setenv("TANDEM_NATIVE_ATTENTION", "0")
    assert not envs.native_kernels(), "the earlier name still turns the kernels off"
    monkeypatch.setenv("TANDEM_PEERS_DIR", str(tmp_path))
    assert envs.peers_dir() == tmp_path
