"""One boundary between packages: no two of tandem's packages (or top-level modules) import each other at module
level, so each has a place in one import order: the step protocol (tandem/step_plan.py) is neutral, rank 0's engine
and "auto" K policy sit above the per-rank drafters, the model runner above the worker's building blocks.
Imports inside functions and under `if TYPE_CHECKING:` are not module-level and not counted."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"


def _unit(path: Path) -> str:
    """The package (or top-level module) a file belongs to: tandem/engine/x.py -> engine, tandem/config.py -> config."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module_level_imports(path: Path) -> set[str]:
    units = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tandem":
            parts = node.module.split(".")
            units |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            units |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tandem.")}
    return units


def test_no_two_packages_import_each_other_at_module_level():
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in PACKAGE.rglob("*.py"):
        unit = _unit(path)
        for other in _module_level_imports(path) - {unit}:
            edges[unit][other].append(str(path.relative_to(PACKAGE.parent)))
    graph = {a: dict(targets) for a, targets in edges.items()}
    cycles = {f"{a} <-> {b}": (graph[a][b], graph[b][a]) for a in graph for b in graph[a]
              if a < b and a in graph.get(b, {})}
    assert not cycles, f"packages importing each other at module level: {cycles}"
    assert graph["engine"]["spec_decode"] and graph["runner"]["worker"], "the check reads the imports it should"


def test_importing_tandem_leaves_the_compiler_unimported():
    """`import tandem` (every process, every rank an engine starts, every CLI command) does not import torch's
    compiler stack: torch._dynamo brings sympy and triton along, ~2.7 s of a 2-core machine's start-up that an eager
    engine never uses. Compiling imports it when it prepares (tandem/compilation/compile.py)."""
    import subprocess
    import sys

    heavy = "('torch._dynamo', 'torch._inductor', 'sympy')"
    code = f"import sys, tandem; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import tandem imported {out.stdout.strip()}"
