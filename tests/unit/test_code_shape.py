"""The shape of `src/diffuserve`, read with `ast` (nothing is imported, so this stays fast and torch-free):

1. no import circle between modules (files), function-level and `TYPE_CHECKING` imports included;
2. no upward import between the layers of docs / DESIGN.md §2-3 (`LAYERS` below), and the engine never imports
   the pipelines (it goes through the executor);
3. no module over `MAX_MODULE_LINES` lines and no function over `MAX_FUNCTION_LINES` lines.

Each check has a `KNOWN_*` allow-list holding exactly the offenders at the time the check was written. The check
fails on a new offender, and also on a listed one that no longer occurs: when a fix lands, remove its entry, so the
lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "diffuserve"

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

FAMILY_PART_LAYERS = {
    "adapter": "families.adapter",
    "ops": "families.adapter",
    "controlnet": "families.adapter",  # a family's ControlNet rows run on the recipe beside its adapter
    "inpaint": "families.adapter",  # a family's inpaint rows too (`families/flux2/inpaint.py`)
    "tiny": "families.tiny",
}
"""`families/<family>/<part>.py` -> its layer name (every other module of `families/` is a leaf)."""

LAYERS: dict[str, float] = {
    # Leaves: shared vocabulary, media and storage formats, hardware probing.
    "diffuserve": 0,
    "paths": 0,
    "errors": 0,
    "families": 0,
    "hardware": 0,
    "activation": 0,  # the activation-memory estimate and budget (pure arithmetic on request fields)
    "media": 0,
    "storage": 0,
    # Pure configuration: what to run (never what a model is made of).
    "sampling": 1,
    "config": 1,
    # Weight placement and streaming; per-row LoRA layers on the model's Linear layers.
    "runtime": 2,
    "lora": 2,
    # Quantized Linear layers (online methods) and applying them to a loaded pipeline's components.
    "quant": 2,
    # The recipes.
    "pipelines": 3,
    # A family's adapter (`families/<f>/adapter.py`, and its maths `ops.py`) runs on the recipe.
    "families.adapter": 3.5,
    # Load / build models into pipelines (`models.loader` builds adapters by name), and parallelise them.
    "models": 4,
    "parallel": 4,
    # A family's tiny-checkpoint builder (`families/<f>/tiny.py`) uses the shared helpers of `models.tiny`.
    "families.tiny": 4.5,
    # One batch -> pipeline calls -> outcomes, on one rank or several.
    "executor": 5,
    # Requests, scheduling, the loops.
    "engine": 6,
    # Composition roots below the HTTP server (the server's runner starts them).
    "launch": 7,
    "demo": 7,
    "server": 8,
    # Entry points.
    "cli": 9,
    "generate": 9,
    "plan_command": 9,
    "generate_masks": 9,  # generate's --mask-path / --padding-mask-crop (flags and the mask check)
    "tools": 9,
}
"""Top-level module or folder of `diffuserve` -> layer. An import between two of them must go to a lower layer."""

FORBIDDEN_SKIPS = {("engine", "pipelines")}
"""Downward imports that still break the design: the engine reaches pipelines only through the executor."""

KNOWN_CYCLES: set[tuple[str, ...]] = set()
"""Import circles (strongly connected modules, sorted) present when this test was written (the engine <-> continuous
and launch <-> launch_ranks circles are gone: issue 25 items 2 and 6)."""

KNOWN_UPWARD: set[tuple[str, str]] = set()
"""(importer, imported) module pairs that point up the layers (or skip the executor) when this test was written."""

KNOWN_LONG_MODULES: set[str] = set()
"""Modules over MAX_MODULE_LINES lines when this test was written."""

KNOWN_LONG_FUNCTIONS: set[str] = set()
"""`module:qualified.name` of functions over MAX_FUNCTION_LINES lines when this test was written."""


def _modules() -> dict[str, Path]:
    """Module name without the `diffuserve.` prefix ("diffuserve" for the package itself) -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts[1:]) or "diffuserve"] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _owner(dotted: str) -> str | None:
    """The module a dotted name (`diffuserve.x.y.Name`) lives in: the longest known prefix."""
    if dotted != "diffuserve" and not dotted.startswith("diffuserve."):
        return None
    name = dotted.removeprefix("diffuserve").removeprefix(".") or "diffuserve"
    while name not in MODULES:
        if "." not in name:
            return "diffuserve" if name else None
        name = name.rpartition(".")[0]
    return name


def _imports(name: str) -> set[str]:
    """The modules `name` imports anywhere in its body (top level, in functions, under TYPE_CHECKING).
    `from pkg import sub` counts `pkg.sub` when it is a module, else `pkg` itself."""
    is_package = MODULES[name].name == "__init__.py"
    here = ["diffuserve", *name.split(".")] if name != "diffuserve" else ["diffuserve"]
    found: set[str | None] = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found.update(_owner(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here if is_package else here[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(_owner(full) if _owner(full) == full.removeprefix("diffuserve.") else _owner(base))
    return {m for m in found if m is not None and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(module: str) -> str:
    """The top-level module or folder; a family folder's adapter (and its maths) and tiny builder are layers of
    their own: the spec is a torch-free leaf, the adapter sits on the recipe, the builder on the model tools."""
    parts = module.split(".")
    if parts[0] == "families" and len(parts) == 3 and parts[2] in FAMILY_PART_LAYERS:
        return FAMILY_PART_LAYERS[parts[2]]
    return parts[0]


def _cycles() -> set[tuple[str, ...]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.add(tuple(sorted(group)))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return groups


def _upward() -> set[tuple[str, str]]:
    found = set()
    for importer, imported in ((a, b) for a, targets in GRAPH.items() for b in targets):
        low, high = _layer(imported), _layer(importer)
        if low != high and (LAYERS[low] > LAYERS[high] or (high, low) in FORBIDDEN_SKIPS):
            found.add((importer, imported))
    return found


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines from `def` to the last line) of every function, nested ones and methods included."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualified = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                found.append((qualified, node.end_lineno - node.lineno + 1))  # type: ignore[operator]
            found += _functions(node, f"{qualified}.")
        else:
            found += _functions(node, prefix)
    return found


def _compare(kind: str, found: set, known: set) -> None:
    new, gone = sorted(found - known), sorted(known - found)
    problems = []
    if new:
        problems.append(f"new {kind}: {new} (fix it; the allow-list in {Path(__file__).name} only shrinks)")
    if gone:
        problems.append(f"fixed {kind}, no longer found: {gone}: remove it from the list in {Path(__file__).name}")
    assert not problems, "\n".join(problems)


def test_every_top_level_module_has_a_layer():
    assert {_layer(m) for m in MODULES} <= set(LAYERS), sorted({_layer(m) for m in MODULES} - set(LAYERS))


def test_no_import_circle_between_modules():
    _compare("import circles", _cycles(), KNOWN_CYCLES)


def test_imports_point_down_the_layers():
    _compare("upward imports (importer, imported)", _upward(), KNOWN_UPWARD)


def test_no_module_over_the_line_limit():
    long = {name for name, path in MODULES.items() if len(path.read_text().splitlines()) > MAX_MODULE_LINES}
    _compare(f"modules over {MAX_MODULE_LINES} lines", long, KNOWN_LONG_MODULES)


def test_no_function_over_the_line_limit():
    long = {
        f"{name}:{qualified}"
        for name, tree in TREES.items()
        for qualified, lines in _functions(tree)
        if lines > MAX_FUNCTION_LINES
    }
    _compare(f"functions over {MAX_FUNCTION_LINES} lines", long, KNOWN_LONG_FUNCTIONS)


def test_the_checks_see_what_they_check():
    """The graph is not empty by accident: a known downward import and a function-level one are found."""
    assert "executor.batch_runner" in GRAPH["engine.engine"] or "executor" in GRAPH["engine.engine"], GRAPH[
        "engine.engine"
    ]
    assert "executor.multirank" in GRAPH["launch.root"]  # function-level imports only
