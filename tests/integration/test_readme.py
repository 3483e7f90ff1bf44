"""The README runs as written: its `bash` and `python` blocks are executed, in order, in one scratch
folder, against the embedded model and real servers, so the README cannot drift from the code.

Rules (the README's Tests section states them too):
- A block whose first line is `# needs a real checkpoint` is skipped; nothing else is.
- A ```` ```yaml file=NAME ```` block is written to NAME (a config file the next block uses).
- The `python` blocks run in order in one interpreter (a later block may use an earlier one's names),
  each against the server the bash block before it started, else the shared one.
- `make ...` lines run as `make -n` (the targets exist and the Makefile parses; `make test` inside the
  test suite would recurse).
- A `diffuserve serve ...` line is checked up to the point where the model would load: its flags and
  `--config` file parse, ServerArgs validate and the deployment plan resolves for its model. When more
  commands follow it in the same block, it is also started for real (on a free port) and they talk to
  it; other blocks talk to the shared test server. `127.0.0.1:30010` is rewritten to the server's port.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serverproc import REPO, ServerProcess

REAL_CHECKPOINT = "# needs a real checkpoint"
README_PORT = "127.0.0.1:30010"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass
class Block:
    lang: str
    info: str
    code: str
    line: int

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


BLOCK_DONE = "@@readme-block-done@@"
PYTHON_SESSION = f"""
import json, sys, traceback
session = {{"__name__": "__main__"}}
for line in sys.stdin:
    try:
        exec(compile(json.loads(line), "<README block>", "exec"), session)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    print({BLOCK_DONE!r}, flush=True)
"""
"""Runs the README's python blocks, one JSON line each on stdin, one after another in one namespace."""


class PythonSession:
    """One interpreter for all python blocks (a later block may use an earlier one's `client`)."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.errors = cwd.parent / "python-session.stderr"  # a file: a full stderr pipe would block the session
        self._stderr = open(self.errors, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-c", PYTHON_SESSION], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)

    def run(self, block: Block, code: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:  # the block's own prints, then the marker
            if line.strip() == BLOCK_DONE:
                return
        self.proc.wait(30)
        raise AssertionError(f"{block.where} failed:\n{self.errors.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(30)
        self._stderr.close()


def readme_blocks() -> list[Block]:
    text = (REPO / "README.md").read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        info = match.group(1).strip()
        lang = info.split()[0] if info else ""
        blocks.append(Block(lang, info, match.group(2), text.count("\n", 0, match.start()) + 1))
    return blocks


def logical_lines(code: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    lines, current = [], ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        lines.append(current + raw)
        current = ""
    if current:
        lines.append(current)
    return lines


def check_serve(argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything `diffuserve serve` does before it loads weights: parse, --config, validate, plan."""
    from diffuserve import cli
    from diffuserve.launch.setup import plan_deployment, resolve_model_path

    monkeypatch.chdir(cwd)
    parser = cli._build_parser()
    ns, extras = parser.parse_known_args(argv)
    assert not extras, f"unknown flags {extras}"
    values = cli._merge_config_file(ns, parser)
    args = cli._server_args(values, ns.config)
    args.validate()
    plan_deployment(args, resolve_model_path(args), "cpu")


def _without_port(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--port":
            skip = True
        elif not item.startswith("--port="):
            out.append(item)
    return out


def test_readme_runs_as_written(singleton_server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    work = tmp_path / "work"
    work.mkdir()
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / "diffuserve"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m diffuserve.cli "$@"\n')
    shim.chmod(0o755)
    cache = tmp_path / "cache"  # the embedded model is built here once, as on a fresh machine
    monkeypatch.setenv("DIFFUSERVE_CACHE", str(cache))
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "DIFFUSERVE_CACHE": str(cache)}
    started: list[ServerProcess] = []
    ran: list[str] = []
    python = PythonSession(work, env)
    last_port = singleton_server.port

    def run_script(block: Block, script: str, port: int) -> None:
        script = script.replace(README_PORT, f"127.0.0.1:{port}")
        script = re.sub(r"^(\s*)make ", rf"\1make -n -C {shlex.quote(str(REPO))} ", script, flags=re.M)
        if not script.strip():
            return
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, f"{block.where} failed ({out.returncode}):\n{script}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        ran.append(block.where)

    try:
        for block in readme_blocks():
            if block.code.lstrip().startswith(REAL_CHECKPOINT):
                continue
            file_name = re.search(r"\bfile=(\S+)", block.info)
            if file_name:
                (work / file_name.group(1)).write_text(block.code)
                continue
            if block.lang == "python":
                # It talks to the server the previous bash block started, else to the shared one.
                python.run(block, block.code.replace(README_PORT, f"127.0.0.1:{last_port}"))
                ran.append(block.where)
                continue
            if block.lang != "bash":
                continue
            port = singleton_server.port
            segment: list[str] = []
            lines = logical_lines(block.code)
            for index, line in enumerate(lines):
                words = shlex.split(line, comments=True)
                if words[:2] != ["diffuserve", "serve"]:
                    segment.append(line)
                    continue
                run_script(block, "\n".join(segment), port)
                segment: list[str] = []
                check_serve(words[1:], work, monkeypatch)
                ran.append(f"{block.where} (checked: {line.strip()[:60]})")
                rest = [w for later in lines[index + 1:] for w in shlex.split(later, comments=True)]
                if rest:  # commands follow that talk to it: start it for real
                    server = ServerProcess(_without_port(words[2:]) + ["--warmup-steps", "1"],
                                           tmp_path / f"server-{len(started)}.log", env={"DIFFUSERVE_CACHE": str(cache)},
                                           cwd=work)
                    started.append(server)
                    server.start(timeout_s=300)
                    port = server.port
            run_script(block, "\n".join(segment), port)
            last_port = port
    finally:
        python.close()
        for server in started:
            server.stop()
    # Guard against the extraction silently matching nothing (a changed fence style, say).
    assert len(ran) >= 10, ran
    assert (work / "out" / "pets_1_1.png").is_file() and (work / "cat.mp4").stat().st_size > 0
    assert (work / "single.json").is_file() and (work / "fox.png").is_file()
