"""Operator-only fault injection for failure tests.

Enabled only through the environment of the server process (`DIFFUSERVE_FAULT_INJECTION`), never
through the HTTP API: with `DIFFUSERVE_FAULT_INJECTION=prompt:<marker>` any batch containing a
request whose prompt contains `<marker>` raises inside the pipeline call, exactly as a failing
stage would. Tests use it to prove that a failing merged batch errors all of its requests and that
the server keeps serving.

`hold:<marker>` (alone, or after a comma: `prompt:<a>,hold:<b>`) slows instead of failing: a text encode or
decode that runs in a side lane beside the denoise loop (`pipelines/lanes.py`) for a request whose prompt
contains `<marker>` waits until the loop has run two more denoising steps (30 s at most). Tests use it to see
from the loop's own step counter that the loop kept stepping while that encode / decode ran.

`hold_step:<marker>` with `release:<path>` (`hold_step:<m>,release:/abs/path`) holds the denoising loop itself: in
a request-level pipeline call whose prompts contain `<marker>`, every denoising step waits, before it is reported
(`on_step`, where the engine checks deadlines), until the file `<path>` exists (`HOLD_STEP_TIMEOUT_S` at most;
after that the call runs freely). It holds on every rank that runs the call (each rank's pipeline is wrapped), so
the ranks stay at one step boundary. Tests arm it by deleting the file, see the request running (it cannot finish
while held, however fast the machine), make the condition under test happen (a deadline passes, a client leaves,
the queue fills) and create the file: the engine sees the condition at the held step's boundary. A file holding a
number N releases steps 1..N only (step N + 1 waits again: a test can let a run reach a preview, then hold it);
an empty file releases all. In continuous mode each step of a group with a marked row waits the same way before it runs
(`check_step`, rank 0 only: the
other ranks wait for its step message).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from diffuserve.pipelines.serving import ServingPipeline

ENV_VAR = "DIFFUSERVE_FAULT_INJECTION"
HOLD_STEP_TIMEOUT_S = 120.0
"""`hold_step:` waits at most this long per pipeline call (a test that never releases must not hang the server)."""
_POLL_S = 0.02

logger = logging.getLogger("diffuserve.faults")


class InjectedFault(RuntimeError):
    """The failure raised by a faulty pipeline stage (test-only)."""


@dataclass(frozen=True)
class StepHold:
    """`hold_step:<marker>,release:<path>`: the steps of a call with `marker` in a prompt wait for `release`."""

    marker: str
    """A prompt containing this holds its call's denoising steps."""
    release: Path
    """The steps go on once this file exists (up to the step number it holds, if any)."""

    def marks(self, batch: list[Any]) -> bool:
        return any(self.marker in p.prompt for p in batch)

    def _releases(self, step: int | None) -> bool:
        try:
            text = self.release.read_text().strip()
        except FileNotFoundError:
            return False
        return not text.isdigit() or step is None or step <= int(text)

    def wait(self, what: str, step: int | None = None) -> bool:
        """Wait until the release file lets (1-based) `step` go on; False when it did not within
        HOLD_STEP_TIMEOUT_S."""
        if self._releases(step):
            return True
        logger.warning("fault injection: holding %s until %s releases it", what, self.release)
        deadline = time.monotonic() + HOLD_STEP_TIMEOUT_S
        while not self._releases(step):
            if time.monotonic() > deadline:
                logger.warning("fault injection: %s never released %s; going on", self.release, what)
                return False
            time.sleep(_POLL_S)
        return True

    def wrap(self, batch: list[Any], on_step: Callable[[int, int], None] | None) -> Callable[[int, int], None] | None:
        """`on_step` for a call of `batch`: held until released when a prompt contains the marker."""
        if not self.marks(batch):
            return on_step
        gave_up = False

        def held(step: int, num_steps: int) -> None:
            nonlocal gave_up
            if not gave_up:
                gave_up = not self.wait(f"denoising step {step + 1}/{num_steps}", step + 1)
            if on_step is not None:
                on_step(step, num_steps)

        return held


@dataclass(frozen=True)
class InjectedFaults:
    """The serving pipeline's fault hooks (`pipelines/serving.FaultHooks`): raise InjectedFault for a call or step
    whose prompts contain `marker`, hold the steps of one marked for `step_hold`."""

    marker: str | None = None
    """A prompt containing this fails its call (or continuous step)."""
    step_hold: StepHold | None = None
    """`hold_step:` - the steps of a marked call wait for the release file."""

    def check(self, batch: Sequence[Any]) -> None:
        if self.marker and any(self.marker in p.prompt for p in batch):
            raise InjectedFault(f"injected fault: a prompt in this batch contains {self.marker!r}")

    def hold(self, batch: Sequence[Any], hooks: dict[str, Any]) -> dict[str, Any]:
        if self.step_hold is None:
            return hooks
        return {**hooks, "on_step": self.step_hold.wrap(list(batch), hooks.get("on_step"))}

    def check_step(self, batch: Sequence[Any]) -> None:
        """Continuous mode, before each step: the same fault (and hold) for a step whose rows include the marker."""
        if self.marker and any(self.marker in p.prompt for p in batch):
            raise InjectedFault(f"injected fault: a prompt in this denoising step contains {self.marker!r}")
        if self.step_hold is not None and self.step_hold.marks(list(batch)):
            self.step_hold.wait("a continuous denoising step")


def inject_faults(pipeline: ServingPipeline, marker: str | None, step_hold: StepHold | None = None) -> ServingPipeline:
    """`pipeline` with fault hooks (tests build these directly; serving reads the environment)."""
    return replace(pipeline, faults=InjectedFaults(marker, step_hold))


def maybe_inject_faults(pipeline: ServingPipeline) -> ServingPipeline:
    """`pipeline` with the faults `DIFFUSERVE_FAULT_INJECTION` asks for (itself when it asks for none)."""
    parts = dict(part.split(":", 1) for part in os.environ.get(ENV_VAR, "").split(",") if ":" in part)
    if parts.get("hold") and (pipeline.lanes is not None or pipeline.capabilities.text_prefetch):
        # Side jobs (decodes, continuous starts, text prefetch) run in the pipeline's lanes only.
        (pipeline.lanes or pipeline.served.lanes()).hold_marker = parts["hold"]
    step_hold = None
    if parts.get("hold_step"):
        release = Path(parts.get("release", ""))
        if not release.is_absolute():
            raise ValueError(f"{ENV_VAR}: hold_step:<marker> needs release:<absolute path of the release file>")
        step_hold = StepHold(parts["hold_step"], release)
    if parts.get("prompt") or step_hold is not None:
        return inject_faults(pipeline, parts.get("prompt"), step_hold)
    return pipeline
