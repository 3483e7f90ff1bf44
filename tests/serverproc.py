"""Run a real `diffuserve serve` process on a free loopback port, for integration tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StartupObservation:
    """Probe answers seen while the server started (for the readiness contract)."""

    seconds: float
    liveness: int | None
    health: int | None
    generation: int | None


@dataclass
class ServerProcess:
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    startup: list[StartupObservation] = field(default_factory=list)
    cwd: Path = REPO
    """Working folder of the server process (relative paths in `args` resolve against it)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 120, observe: bool = False, headers: dict | None = None) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # Each test server keeps its results store beside its log unless the test names one (so jobs
        # of other servers and earlier sessions never show up in its listings).
        own_outputs = self.log_path.parent / "outputs"
        outputs = [] if "--output-dir" in self.args else ["--output-dir", str(own_outputs)]
        # DIFFUSERVE_TEST_API_PROCESS=separate runs every test server with its engine in its own process.
        layout = os.environ.get("DIFFUSERVE_TEST_API_PROCESS")
        outputs += ["--api-process", layout] if layout and "--api-process" not in self.args else []
        cmd = [sys.executable, "-m", "diffuserve.cli", "serve", "--port", str(self.port), *self.args, *outputs]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        started = time.monotonic()
        with httpx.Client(timeout=2.0, headers=headers) as client:
            while time.monotonic() - started < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
                live = health = gen = None
                try:
                    live = client.get(f"{self.base_url}/liveness").status_code
                    if observe:
                        # The generation probe goes before /health: readiness only ever turns on, so an
                        # observation with health 503 saw the server not ready for its generation too
                        # (probed the other way round, warm-up could finish between the two).
                        gen = client.post(
                            f"{self.base_url}/v1/images/generations", json={"prompt": "early", "size": "64x64"}
                        ).status_code
                    health = client.get(f"{self.base_url}/health").status_code
                except httpx.HTTPError:
                    pass
                if observe:
                    self.startup.append(StartupObservation(time.monotonic() - started, live, health, gen))
                if health == 200:
                    return self
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout_s}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log(self, pattern: str, *, start: int = 0, timeout_s: float = 20) -> re.Match:
        """Until the output from offset `start` matches `pattern` (a regex), within `timeout_s`. For the lines that
        are themselves the behaviour under test; state is read from /health, /metrics and the answers."""
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(pattern, self.log()[start:])):
            assert time.monotonic() < deadline, f"never matched {pattern!r}; tail:\n{self.log()[start:][-3000:]}"
            time.sleep(0.05)
        return match

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
