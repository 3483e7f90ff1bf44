"""The CLI as the second newcomer met it (issue 34 item 6): a bad flag is named even when the port is taken, a
misspelt flag's suggestion is the last line (after a one-line usage), and a Ctrl-C while the command starts is one
line and exit 130. Real `diffuserve` processes; no weights are loaded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.serverproc import REPO, free_port


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_a_bad_flag_is_named_even_when_the_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _cli("serve", "--port", str(port), "--batching-max-size", "0")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "--batching-max-size" in lines[0] and "already in use" not in lines[0], lines[0]


def test_a_misspelt_flag_shows_one_usage_line_and_the_suggestion_last():
    out = _cli("serve", "--batching-max-szie", "3", "--port", str(free_port()))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[0] == "usage: diffuserve serve [FLAGS]  (every flag: diffuserve serve --help)"
    assert lines[1].endswith("--batching-max-szie 3 (did you mean --batching-max-size?)"), lines[1]
    both = _cli("generate", "--promt", "x", "--num-inferense-steps", "2").stderr.strip().splitlines()
    assert len(both) == 2 and both[1].endswith(
        "(did you mean --prompt for --promt, --num-inference-steps for --num-inferense-steps?)"
    ), both


# Modules `serve` imports in order while it starts, each after the last (their `-X importtime` lines gate the
# signal): cli.py's own imports (argparse, then the configs through pydantic), the server runner (uvicorn, whose
# import is followed by the runner's start-up handler), then torch.
GATES = ["argparse", "pydantic", "diffuserve.config.server_args", "uvicorn", "torch"]


@pytest.mark.parametrize("gate", GATES)
def test_ctrl_c_while_serve_starts_is_one_line_and_exit_130(gate: str):
    """SIGINT as soon as the process has imported `gate` (read from its `-X importtime` lines, so the signal lands
    in that phase however fast the machine is): exit 130 and one line, never a KeyboardInterrupt traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "diffuserve.cli", "serve", "--port", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == gate:
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail(f"serve never imported {gate}:\n{''.join(seen)[-3000:]}")
        seen += proc.stderr.readlines()
        assert proc.wait(60) == 130, "".join(seen)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = [line.strip() for line in seen if not line.startswith("import time:") and line.strip()]
    for never in ("Traceback", "KeyboardInterrupt"):
        assert never not in "\n".join(said), "\n".join(said)
    # Before the log is set up: the CLI's line; after it, the start-up handler's (earlier log lines are the plan's).
    assert said and (
        said[-1] == "diffuserve serve: interrupted"
        or "SIGINT during start-up (starting): stopping before serving" in said[-1]
    ), said


def test_serve_caps_glibc_malloc_arenas_unless_the_operator_chose(tmp_path):
    """`serve` caps glibc's malloc arenas (the soak's RSS plateau); an operator's MALLOC_ARENA_MAX is left alone."""
    code = "from diffuserve.server.runner import limit_malloc_arenas; print(limit_malloc_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    chosen = subprocess.run(
        [sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"}, capture_output=True, text=True, check=True
    )
    assert chosen.stdout.strip() == "False"
    assert capped.stdout.strip() == ("True" if sys.platform.startswith("linux") else "False")
