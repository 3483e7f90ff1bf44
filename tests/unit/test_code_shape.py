"""The shape of `src/diffuserve`, read with `ast` (nothing is imported, so this stays fast and torch-free):

1. no import circle between modules (files), function-level and `TYPE_CHECKING` imports included, and none between
   folders (the top-level modules and folders of `diffuserve`, from the same module imports);
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
    "tiny": "families.tiny",
}
"""`families/<family>/<part>.py` -> its layer name; every other module of `families/` (the adapter and its helpers) is
in the `families` layer, on the recipe. A layer of the module check only: the folder check sees one `families`."""

LAYERS: dict[str, float] = {
    # Leaves: shared vocabulary (the family specs, checkpoint facts and registry), media and storage formats, hardware
    # probing.
    "diffuserve": 0,
    "paths": 0,
    "errors": 0,
    "family_spec": 0,
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
    "step_cache": 2,  # per-row step caches: hooks on the denoiser's blocks, each row's history and policies
    # Quantized Linear layers (online methods) and applying them to a loaded pipeline's components.
    "quant": 2,
    # The recipes.
    "pipelines": 3,
    # The family plug-ins: a family's adapter (`families/<f>/adapter.py`, its maths, ControlNet rows, inpaint start and
    # models) runs on the recipe.
    "families": 3.5,
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

KNOWN_FOLDER_CYCLES: set[tuple[str, ...]] = set()
"""Import circles between folders (strongly connected top-level modules and folders, sorted) when this check was
written (the loop through `families/` is gone: issue 30 item 5 made the family vocabulary the leaf `family_spec/`)."""

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


def _folder(module: str) -> str:
    """The top-level module or folder a module is in (`engine.engine` -> `engine`)."""
    return module.split(".")[0]


FOLDER_GRAPH: dict[str, set[str]] = {}
"""Top-level module or folder -> the others its modules import (the module graph, folded)."""
for _importer, _targets in GRAPH.items():
    FOLDER_GRAPH.setdefault(_folder(_importer), set()).update(
        _folder(t) for t in _targets if _folder(t) != _folder(_importer)
    )


def _layer(module: str) -> str:
    """The top-level module or folder; a family folder's adapter (and its maths) and tiny builder are layers of
    their own: the spec is a torch-free leaf, the adapter sits on the recipe, the builder on the model tools."""
    parts = module.split(".")
    if parts[0] == "families" and len(parts) == 3 and parts[2] in FAMILY_PART_LAYERS:
        return FAMILY_PART_LAYERS[parts[2]]
    return parts[0]


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected groups of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
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

    for node in sorted(graph):
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
    _compare("import circles", _cycles(GRAPH), KNOWN_CYCLES)


def test_no_import_circle_between_folders():
    found = _cycles(FOLDER_GRAPH)
    edges = [
        f"{a} -> {b}"
        for group in sorted(found - KNOWN_FOLDER_CYCLES)
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if _folder(a) != _folder(b) and _folder(a) in group and _folder(b) in group
    ]
    assert not edges, (
        f"new folder import circles {sorted(found - KNOWN_FOLDER_CYCLES)}; the module imports between their folders: "
        f"{edges} (move the misplaced module or invert the dependency; the allow-list in {Path(__file__).name} only "
        "shrinks)"
    )
    _compare("folder import circles", found, KNOWN_FOLDER_CYCLES)


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
    # The folder graph: the family plug-ins sit on the recipe and the model tools, over the leaf vocabulary.
    assert {"pipelines", "models", "family_spec"} <= FOLDER_GRAPH["families"], FOLDER_GRAPH["families"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
