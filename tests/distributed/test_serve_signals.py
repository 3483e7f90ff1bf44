"""Stopping a torchrun deployment (issue 22 item 3): SIGTERM drains on rank 0, which then stops the other ranks.

torchrun signals every rank at once; the ranks without HTTP ignore it once they serve (rank 0 stops them after its
drain), so nothing is cut mid-batch. SIGTERM to rank 0 ends torchrun with 0;
SIGTERM to the launcher itself (`diffuserve-torchrun`, torchrun with the signal turned into an exit code) ends the
ranks the same way and exits 0, without a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serverproc import REPO, free_port


def _start(tiny_flux_path: Path, tmp_path: Path, launcher: list[str]) -> tuple[subprocess.Popen, Path, int]:
    port, log_path = free_port(), tmp_path / "torchrun.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child holds it; closed when the test's process ends
    proc = subprocess.Popen(
        [
            *launcher,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(tiny_flux_path),
            "--device",
            "cpu",
            "--num-gpus",
            "2",
            "--enable-cfg-parallel",
            "--port",
            str(port),
            "--output-dir",
            str(tmp_path / "outputs"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, log_path, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


TORCHRUN = [str(Path(sys.executable).with_name("torchrun"))]
"""Plain torchrun: signalled through rank 0."""
LAUNCHER = [sys.executable, "-m", "diffuserve.launch.torchrun"]
"""`diffuserve-torchrun`: signalled itself, as an orchestrator stops a pod's first process."""


@pytest.mark.parametrize(
    ("target", "launcher"), [("rank0", TORCHRUN), ("launcher", LAUNCHER)], ids=["rank0", "launcher"]
)
def test_sigterm_drains_every_rank(tiny_flux_path: Path, tmp_path: Path, target: str, launcher: list[str]):
    proc, log_path, _ = _start(tiny_flux_path, tmp_path, launcher)
    try:
        rank0 = int(re.search(r"Started server process \[(\d+)\]", log_path.read_text()).group(1))
        os.kill(rank0 if target == "rank0" else proc.pid, signal.SIGTERM)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    # What the shutdown says (docs/operations.md), and that nothing failed on the way: one read of its output.
    output = log_path.read_text()
    assert code == 0, output[-3000:]
    said = ["drained; exiting", "rank 1: shutdown"]
    said += ["diffuserve-torchrun: stopped by SIGTERM"] if target == "launcher" else []
    never = ["ChannelClosed", "not every rank confirmed", "Traceback", "ChildFailedError"]
    assert [s for s in said if s not in output] == [] and [s for s in never if s in output] == [], output[-3000:]
