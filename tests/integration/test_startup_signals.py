"""Signals before a server served, and a port in use: real processes, real signals (issue 22 items 3-4, 7).

The warm-up is held with the operator-only `hold_step` fault (its prompt is "warm-up"), so the signal lands in
warm-up however fast the machine is; each test gates on the phase /health reports (or, before HTTP is up, the
plan's start-up line), never on a sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.helpers import wait_draining
from tests.serverproc import REPO, ServerProcess
from tests.step_hold import StepHold, running


def _phase(server: ServerProcess) -> str | None:
    """The start-up phase /health names (loading, warming_up; 503 until ready); None before HTTP is up."""
    try:
        return httpx.get(f"{server.base_url}/health", timeout=2).json()["status"]
    except httpx.HTTPError:
        return None


def _reach(server: ServerProcess, gate: str | tuple[str, ...], timeout_s: float = 180) -> None:
    """Until /health reports one of the phases `gate` names, or (a str) the start-up output shows `gate`."""
    deadline = time.monotonic() + timeout_s
    while not (gate in server.log() if isinstance(gate, str) else _phase(server) in gate):
        assert server.proc is not None and server.proc.poll() is None, server.log()[-3000:]
        assert time.monotonic() < deadline, f"never reached {gate!r}:\n{server.log()[-3000:]}"
        time.sleep(0.05)


def _held_warmup_server(tiny_flux_path: Path, tmp_path: Path) -> ServerProcess:
    """A server whose warm-up generation waits at its first step until the test releases it (it never does)."""
    release = tmp_path / "release-warm-up"
    env = {"DIFFUSERVE_FAULT_INJECTION": f"hold_step:warm-up,release:{release}"}
    server = ServerProcess(["--model-path", str(tiny_flux_path)], tmp_path / "server.log", env=env)
    cmd = [
        sys.executable,
        "-m",
        "diffuserve.cli",
        "serve",
        "--port",
        str(server.port),
        *server.args,
        "--output-dir",
        str(tmp_path / "outputs"),
    ]
    server._log = open(server.log_path, "wb")  # noqa: SIM115 - closed by server.stop()
    server.proc = subprocess.Popen(
        cmd, stdout=server._log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}
    )
    return server


@pytest.mark.parametrize(
    ("sig", "code", "gate", "phases"),
    # One process per case: each phase once, and each signal through uvicorn's handler (loading, warming up); the
    # exit code follows the signal alone (`runner.stop_before_serving`). SIGINT at import time: test_cli_third_hour.
    [
        (signal.SIGTERM, 0, ("warming_up",), ("warming_up",)),
        (signal.SIGINT, 130, ("loading", "warming_up"), ("loading", "warming_up")),
        # The plan is logged before uvicorn runs (no /health yet): the CLI's own start-up handler (or uvicorn's, if
        # it already took over).
        (signal.SIGINT, 130, "deployment plan:", ("starting", "loading", "warming_up")),
    ],
)
def test_signal_before_serving_stops_at_once(tiny_flux_path: Path, tmp_path: Path, sig, code, gate, phases):
    server = _held_warmup_server(tiny_flux_path, tmp_path)
    try:
        _reach(server, gate)
        server.signal(sig)
        # The warm-up stays held for HOLD_STEP_TIMEOUT_S (120 s): exiting well within that shows the process did
        # not wait for it (nor for the engine thread's 10 s join).
        exit_code = server.proc.wait(30)
        assert exit_code == code, server.log()[-3000:]
    finally:
        server.stop()
    # The one line it says (docs/operations.md), and nothing of a served or crashed process: one read of its output.
    output = server.log()
    name = signal.Signals(sig).name
    said = [f"{name} during start-up ({phase}): stopping before serving, exit {code}" for phase in phases]
    never = ["ready to serve", "drained", "Traceback", "KeyboardInterrupt", "terminate called"]
    assert any(s in output for s in said) and [s for s in never if s in output] == [], output[-3000:]


def test_port_in_use_fails_before_the_model_loads(tiny_flux_path: Path, tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "diffuserve.cli",
                "serve",
                "--model-path",
                str(tiny_flux_path),
                "--port",
                str(port),
                "--output-dir",
                str(tmp_path / "outputs"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "--port" in lines[0], result.stderr
    assert "serving" not in result.stderr + result.stdout
    assert "Loading" not in result.stderr + result.stdout


def test_second_signal_says_what_happened_once(tiny_flux_path: Path, tmp_path: Path):
    hold = StepHold(tmp_path)
    hold.arm()
    server = ServerProcess(
        ["--model-path", str(tiny_flux_path), "--shutdown-timeout-s", "600"], tmp_path / "log", env=hold.env()
    )
    server.start()
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                f"{server.base_url}/v1/images/generations",
                json={"prompt": f"slow {StepHold.MARKER}", "size": "64x64"},
                timeout=120,
            )
        )
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not running(server):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)
    server.signal(signal.SIGTERM)
    wait_draining(server.base_url)  # the drain has begun
    server.signal(signal.SIGTERM)
    thread.join(60)
    hold.release()
    assert server.proc.wait(60) == 130
    server.stop()
    # Exit 130 (not 0): neither a completed drain nor the shutdown timeout ended it, the second signal did.
    assert answers and answers[0].status_code == 503
    log = server.log()
    assert log.count("SIGTERM again: answered 1 unfinished request(s) with 503; exiting 130") == 1, log
