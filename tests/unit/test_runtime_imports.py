"""The imports inside runtime/ point one way (residency -> layerwise -> strategy -> weights): no cycle, not even
through a function-level import."""

from __future__ import annotations

import ast
from pathlib import Path

import diffuserve

RUNTIME = Path(diffuserve.__file__).parent / "runtime"


def _runtime_imports(path: Path) -> set[str]:
    """The runtime modules `path` imports anywhere in its body (top level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n.rsplit(".", 1)[-1] for n in names if n.startswith("diffuserve.runtime."))
    return found - {path.stem}


def test_runtime_modules_import_each_other_without_a_cycle():
    graph = {p.stem: _runtime_imports(p) & {q.stem for q in RUNTIME.glob("*.py")} for p in RUNTIME.glob("*.py")}
    assert "residency" not in graph["layerwise"], graph
    assert graph["weights"] <= {"ledger"}, graph

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in graph[start])

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, graph
