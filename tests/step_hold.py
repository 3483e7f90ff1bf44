"""The test side of the operator-only `hold_step:` fault (`pipelines/fault_hooks.py`): gate a test on observed
state, not on how fast the machine denoises.

A server started with `StepHold.env()` holds every denoising step of a request whose prompt contains
`StepHold.MARKER` until the release file exists. Arm, send the marked request, wait for what the test needs
(the request running, the queue filling, a deadline passing, a client gone), then release: the engine sees that
condition at the held step's boundary, however fast or slow the machine is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.serverproc import ServerProcess


class StepHold:
    """One server's release file."""

    MARKER = "HOLD-THIS-STEP"
    """Put it in a prompt to hold that request's denoising steps."""

    def __init__(self, folder: Path):
        self.release_file = folder / "release-held-steps"

    def env(self, *, fail_marker: str | None = None) -> dict[str, str]:
        """The server's fault-injection environment (with `prompt:<fail_marker>` when given)."""
        parts = [f"prompt:{fail_marker}"] if fail_marker else []
        parts += [f"hold_step:{self.MARKER}", f"release:{self.release_file}"]
        return {"DIFFUSERVE_FAULT_INJECTION": ",".join(parts)}

    def arm(self) -> None:
        """From now on marked requests wait at their denoising steps."""
        self.release_file.unlink(missing_ok=True)

    def release(self, steps: int | None = None) -> None:
        """Let every held step go on, or (`steps`) steps 1..steps of each marked call only."""
        staged = self.release_file.with_suffix(".staged")
        staged.write_text("" if steps is None else str(steps))
        staged.replace(self.release_file)  # atomic: the server never reads a half-written number

    def release_when(self, condition: Callable[[], bool], timeout_s: float = 120) -> threading.Thread:
        """Release from a background thread once `condition()` holds (or after `timeout_s`, so nothing hangs:
        the test's own assertions then report what went wrong)."""

        def main() -> None:
            deadline = time.monotonic() + timeout_s
            try:
                while time.monotonic() < deadline and not condition():
                    time.sleep(0.05)
            finally:
                self.release()

        thread = threading.Thread(target=main, daemon=True)
        thread.start()
        return thread


def running(server: ServerProcess, headers: dict | None = None) -> bool:
    """A batch is running (observed from /metrics); a held one stays so until released."""
    text = httpx.get(f"{server.base_url}/metrics", headers=headers, timeout=10).text
    return any(
        line.startswith("diffuserve_running_batch_size ") and float(line.split()[-1]) > 0 for line in text.splitlines()
    )


def wait_idle(server: ServerProcess, headers: dict | None = None, timeout_s: float = 60) -> None:
    """No batch running: the gauge is reset only after the previous request was answered, so a test waits for
    this before sending the request whose start it then observes."""
    deadline = time.monotonic() + timeout_s
    while running(server, headers):
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.05)


def seconds_after_running(server: ServerProcess, seconds: float, headers: dict | None = None) -> Callable[[], bool]:
    """A condition: true `seconds` after a batch was first seen running. A request's deadline of `seconds` (counted
    from its arrival, which came before it ran) has then passed. Call it before sending that request: it first
    waits until the server is idle, so the batch it sees is the request's own."""
    wait_idle(server, headers)
    seen: list[float] = []

    def condition() -> bool:
        if not seen and running(server, headers):
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() > seen[0] + seconds

    return condition
