"""The arrows of issue 25 item 6, read from the source (function-level imports included):

- launch/ imports one way (ranks <- setup <- follower <- root): no circle, and `ranks` knows no model code;
- only executor/channel.py touches the TCP store, and only executor/protocol.py spells its keys;
- pipelines/ never imports models/ (the loader applies a checkpoint's suggested defaults on both backends);
- config/ never imports models/ (the cache folder lives in diffuserve/paths.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import diffuserve

PACKAGE = Path(diffuserve.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every diffuserve module `path` imports anywhere in its body (top level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("diffuserve.")}


def test_launch_modules_import_one_way():
    modules = ("ranks", "setup", "follower", "root")
    graph = {
        m: {n for n in modules if f"diffuserve.launch.{n}" in _imports(PACKAGE / "launch" / f"{m}.py")} for m in modules
    }
    allowed = {
        "ranks": set(),
        "setup": {"ranks"},
        "follower": {"ranks", "setup"},
        "root": {"ranks", "setup", "follower"},
    }
    assert all(graph[m] <= allowed[m] for m in modules), graph
    ranks = _imports(PACKAGE / "launch" / "ranks.py")
    assert not {n for n in ranks if n.split(".")[1] in ("executor", "engine", "pipelines", "models", "runtime")}, ranks
    assert not (PACKAGE / "launch.py").exists() and not (PACKAGE / "launch_ranks.py").exists()


def test_only_the_channel_touches_the_store_and_only_the_protocol_names_keys():
    """executor/channel.py is the transport, executor/protocol.py owns every key; every role uses its links."""
    keys = ("batch/", "report/", "progress/", "cancel/", "call/", "ack/", "bye/", "heartbeat/", "fault/", '"rank/')
    for path in PACKAGE.rglob("*.py"):
        text, name = path.read_text(), path.relative_to(PACKAGE).as_posix()
        # `args.store` (ServerArgs' `self.store`) is the results-store flags section, not the TCP store
        text = re.sub(r"\bargs\.store\." if name != "config/server_args.py" else r"\bself\.store\.", "args.", text)
        if name != "executor/channel.py":
            assert ".store." not in text and "_store." not in text and "store.add(" not in text, name
        if name != "executor/protocol.py" and name.startswith(("executor/", "launch/")):
            assert not [k for k in keys if f'f"{k}' in text or f"'{k}" in text], name


def test_pipelines_import_nothing_from_models():
    """The loader (models/) imports the adapters and hands them a checkpoint's suggested defaults."""
    for path in (PACKAGE / "pipelines").rglob("*.py"):
        found = {n for n in _imports(path) if n.startswith("diffuserve.models")}
        assert not found, (path.name, found)


def test_config_imports_nothing_from_models_and_paths_imports_nothing():
    """config/ reads the cache folder from diffuserve/paths.py, which stands below every other module."""
    for path in (PACKAGE / "config").rglob("*.py"):
        found = {n for n in _imports(path) if n.startswith("diffuserve.models")}
        assert not found, (path.name, found)
    assert not _imports(PACKAGE / "paths.py")
