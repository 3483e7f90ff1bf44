"""The README and the pages of docs/ run as written: their `bash` and `python` blocks are executed, in order, in
one scratch folder, against the embedded model and real servers, so the docs cannot drift from the code; and
every relative link in them resolves.

Rules (docs/testing.md states them too):
- The pages run in order: README.md, then docs/*.md by name. A block whose first line is
  `# needs a real checkpoint` is skipped; so are blocks in other languages (`text`, `json`, `yaml` ...).
- A ```` ```LANG file=NAME ```` block is written to NAME (a config file the next block uses).
- The `python` blocks run in order in one interpreter (a later block may use an earlier one's names),
  each against the server the bash block before it in the same page started, else the shared one.
- `make ...` lines run as `make -n` (the targets exist and the Makefile parses; `make test` inside the
  test suite would recurse).
- A `diffuserve serve ...` line is checked up to the point where the model would load: its flags and
  `--config` file parse, ServerArgs validate and the deployment plan resolves for its model. When more
  commands follow it in the same block, it is also started for real (on a free port; once per command line,
  so a later page repeating the line talks to the same server) and they talk to it; other blocks talk to the
  shared test server. `127.0.0.1:30010` is rewritten to the server's port, and so is `127.0.0.1:P` once a started
  server's line gave `--port P` (a second server on a free port, beside `make serve`'s 30010).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serverproc import REPO, ServerProcess

REAL_CHECKPOINT = "# needs a real checkpoint"
NOT_RUN = (REAL_CHECKPOINT, "# needs PostgreSQL and SeaweedFS")
"""First lines of blocks that are not run (tests/stores.py takes the PostgreSQL and SeaweedFS recipe's steps)."""
README_PORT = "127.0.0.1:30010"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


DOC_PAGES = ("README.md", "docs/*.md")
"""Pages whose blocks run, in this order (a glob in name order)."""
LINKED_PAGES = ("README.md", "docs/*.md", "benchmarks/README.md")
"""Pages whose relative links must resolve."""


def doc_pages(patterns: tuple[str, ...] = DOC_PAGES) -> list[Path]:
    pages: list[Path] = []
    for pattern in patterns:
        pages += [p for p in sorted(REPO.glob(pattern)) if p not in pages]
    return pages


@dataclass
class Block:
    lang: str
    info: str
    code: str
    line: int
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


BLOCK_DONE = "@@readme-block-done@@"
PYTHON_SESSION = f"""
import json, sys, traceback
session = {{"__name__": "__main__"}}
for line in sys.stdin:
    try:
        exec(compile(json.loads(line), "<docs block>", "exec"), session)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    print({BLOCK_DONE!r}, flush=True)
"""
"""Runs the pages' python blocks, one JSON line each on stdin, one after another in one namespace."""


class PythonSession:
    """One interpreter for all python blocks (a later block may use an earlier one's `client`)."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.errors = cwd.parent / "python-session.stderr"  # a file: a full stderr pipe would block the session
        self._stderr = open(self.errors, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PYTHON_SESSION],
            cwd=cwd,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

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


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        info = match.group(1).strip()
        lang = info.split()[0] if info else ""
        blocks.append(
            Block(lang, info, match.group(2), text.count("\n", 0, match.start()) + 1, str(page.relative_to(REPO)))
        )
    return blocks


def readme_blocks() -> list[Block]:
    return page_blocks(REPO / "README.md")


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


def _port_of(argv: list[str]) -> str | None:
    """The value of `--port` in a command line, if any."""
    for index, item in enumerate(argv):
        if item == "--port" and index + 1 < len(argv):
            return argv[index + 1]
        if item.startswith("--port="):
            return item.split("=", 1)[1]
    return None


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


class DocsRun:
    """The state of one run over the pages: the scratch folder, the python session and the servers started."""

    def __init__(self, tmp_path: Path, shared_port: int, monkeypatch: pytest.MonkeyPatch):
        self.tmp_path, self.shared_port, self.monkeypatch = tmp_path, shared_port, monkeypatch
        self.work = tmp_path / "work"
        self.work.mkdir()
        shims = tmp_path / "bin"
        shims.mkdir()
        shim = shims / "diffuserve"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m diffuserve.cli "$@"\n')
        shim.chmod(0o755)
        self.cache = tmp_path / "cache"  # the embedded model is built here once, as on a fresh machine
        monkeypatch.setenv("DIFFUSERVE_CACHE", str(self.cache))
        self.env = {
            **os.environ,
            "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
            "DIFFUSERVE_CACHE": str(self.cache),
        }
        self.started: dict[tuple[str, ...], ServerProcess] = {}
        """Servers started for real, by their command line (a repeated line reuses its server)."""
        self.addresses: dict[str, int] = {}
        """`127.0.0.1:P` of a started server whose line gave `--port P` -> its real port."""
        self.ran: list[str] = []
        self.seconds: dict[str, float] = {}
        """Wall time per block (printed slowest first: `pytest -s` shows where the test's time goes)."""
        self.python = PythonSession(self.work, self.env)

    def close(self) -> None:
        self.python.close()
        for server in self.started.values():
            server.stop()

    def run_page(self, page: Path) -> None:
        last_port = self.shared_port  # each page starts against the shared server
        for block in page_blocks(page):
            started = time.monotonic()
            last_port = self.run_block(block, last_port)
            self.seconds[block.where] = time.monotonic() - started

    def run_block(self, block: Block, last_port: int) -> int:
        """Runs one block; returns the port the next python block talks to."""
        if block.code.lstrip().startswith(NOT_RUN):
            return last_port
        file_name = re.search(r"\bfile=(\S+)", block.info)
        if file_name:
            (self.work / file_name.group(1)).write_text(block.code)
            return last_port
        if block.lang == "python":
            # It talks to the server the previous bash block started, else to the shared one.
            self.python.run(block, self.rewrite(block.code.replace(README_PORT, f"127.0.0.1:{last_port}")))
            self.ran.append(block.where)
        elif block.lang == "bash":
            return self.run_bash(block)
        return last_port

    def run_bash(self, block: Block) -> int:
        """Runs the block (serve lines checked, and started when commands follow); returns the port it used."""
        port = self.shared_port
        segment: list[str] = []
        lines = logical_lines(block.code)
        for index, line in enumerate(lines):
            words = shlex.split(line, comments=True)
            if words[:2] != ["diffuserve", "serve"]:
                segment.append(line)
                continue
            self.run_script(block, "\n".join(segment), port)
            segment = []
            check_serve(words[1:], self.work, self.monkeypatch)
            self.ran.append(f"{block.where} (checked: {line.strip()[:60]})")
            rest = [w for later in lines[index + 1 :] for w in shlex.split(later, comments=True)]
            if rest:  # commands follow that talk to it: start it for real
                port = self.server(words[2:]).port
                given = _port_of(words)
                if given is not None:  # the page's own port for this server: its commands reach it there
                    self.addresses[f"127.0.0.1:{given}"] = port
        self.run_script(block, "\n".join(segment), port)
        return port

    def server(self, argv: list[str]) -> ServerProcess:
        key = tuple(_without_port(argv))
        if key not in self.started:
            server = ServerProcess(
                list(key) + ["--warmup-steps", "1"],
                self.tmp_path / f"server-{len(self.started)}.log",
                env={"DIFFUSERVE_CACHE": str(self.cache)},
                cwd=self.work,
            )
            self.started[key] = server
            server.start(timeout_s=300)
        return self.started[key]

    def rewrite(self, code: str) -> str:
        """The pages' `127.0.0.1:P` of servers started with `--port P` -> their real ports."""
        for address, port in self.addresses.items():
            code = code.replace(address, f"127.0.0.1:{port}")
        return code

    def run_script(self, block: Block, script: str, port: int) -> None:
        script = self.rewrite(script.replace(README_PORT, f"127.0.0.1:{port}"))
        script = re.sub(r"^(\s*)make ", rf"\1make -n -C {shlex.quote(str(REPO))} ", script, flags=re.M)
        if not script.strip():
            return
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, (
            f"{block.where} failed ({out.returncode}):\n{script}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
        self.ran.append(block.where)


@pytest.mark.timeout(900)  # every docs page's blocks, several servers among them: past the suite's 300 s default
def test_readme_runs_as_written(singleton_server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """README.md, then every docs/*.md page, in one scratch folder (the test keeps its name from README days)."""
    run = DocsRun(tmp_path, singleton_server.port, monkeypatch)
    try:
        for page in doc_pages():
            run.run_page(page)
    finally:
        run.close()
        print("slowest blocks:", sorted(run.seconds.items(), key=lambda item: -item[1])[:8])
    # Guard against the extraction silently matching nothing (a changed fence style, say).
    assert len(run.ran) >= 10, run.ran
    assert {b.split(":")[0] for b in run.ran} >= {"README.md", "docs/api.md"}, run.ran
    work = run.work
    assert (work / "out" / "pets_1_1.png").is_file() and (work / "cat.mp4").stat().st_size > 0
    assert (work / "single.json").is_file() and (work / "fox.png").is_file()


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """The page without fenced blocks and inline code (links and headings inside them do not count)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every #anchor a link into `page` may use: heading slugs (with GitHub's -1, -2 for repeats) and <a id>."""
    text = _FENCE.sub("", page.read_text())
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for match in _HEADING.finditer(text):
        slug = github_slug(match.group(2))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file or #anchor does not exist."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading or <a id> '{anchor}' in {linked.name})")
    return broken


def test_every_relative_link_resolves() -> None:
    pages = doc_pages(LINKED_PAGES)
    assert REPO / "benchmarks" / "README.md" in pages and len(pages) > 3, pages
    broken = {str(page.relative_to(REPO)): found for page in pages if (found := broken_links(page))}
    assert not broken, broken


def test_link_checker_sees_broken_links(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Some `code` title (v2)\n\n## Repeat\n\n## Repeat\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#some-code-title-v2) [ok](b.md#repeat-1) [bad](b.md#nope) [bad](c.md)\n"
        "`[skipped](d.md)` [web](https://example.com/x) [self](#a-title)\n\n# A title\n"
        "```bash\n# not a heading\n[in code](e.md)\n```\n"
    )
    assert broken_links(page) == ["b.md#nope (no heading or <a id> 'nope' in b.md)", "c.md (no such file)"]
