"""What a graceful stop waits for besides the engine: the tasks that drive asynchronous jobs (videos, meshes).

A job's answer from the engine is not its end: its driver still encodes the MP4 or GLB, writes the file to the
media store and commits the `completed` row. The drain (server/runner.py) waits for the engine's generation and
then for these drivers, within the same --shutdown-timeout-s. A job the drain could not finish ends `failed`
with code `shutdown` and a message that says so (STOPPED_CODE), never the `interrupted` of a process that was
killed or crashed: the engine's drain answers its unfinished requests with a 503, which a driver records as
this error (`failure`), and the jobs still encoding or writing at the deadline are marked here (`stop_rest`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from diffuserve.errors import DiffuserveError, ServiceUnavailableError
from diffuserve.server.protocol import error_envelope

logger = logging.getLogger("diffuserve.server")

STOPPED_CODE = "shutdown"
"""`error.code` of a job the server stopped during a graceful drain (a killed or crashed one: `interrupted`)."""


def stopped_error(reason: str) -> dict[str, Any]:
    """The error a job keeps when a drain ended before it finished; `reason` says what ended the drain."""
    return error_envelope(
        f"The server was stopped during a graceful drain before this job finished ({reason}); create the job again.",
        "server_error",
        None,
        STOPPED_CODE,
    )["error"]


MARK_TIMEOUT_S = 10.0
"""How long the drain waits, past its deadline, for the stopped jobs' rows to be written."""


@dataclass
class _Driver:
    task: asyncio.Future[None]
    mark_stopped: Callable[[dict[str, Any]], Any]
    """Ends the job `failed` with the given error (blocking store I/O; a no-op once the job has ended)."""


class JobDrivers:
    """The job-driving tasks of this process, by job id (each leaves once its job has ended)."""

    def __init__(self) -> None:
        self._drivers: dict[str, _Driver] = {}
        self._stopped: set[str] = set()
        """Jobs the drain ended as stopped (by `failure` or `stop_rest`)."""
        self.stop_reason: str | None = None
        """Set when a drain starts: what a job failed by the drain was stopped by (None while serving)."""

    def __len__(self) -> int:
        return len(self._drivers)

    def track(self, job_id: str, task: asyncio.Future[None], mark_stopped: Callable[[dict[str, Any]], Any]) -> None:
        """Keep `task` (it drives job `job_id`) until it is done."""
        self._drivers[job_id] = _Driver(task, mark_stopped)
        task.add_done_callback(lambda _: self._drivers.pop(job_id, None))

    def failure(self, job_id: str, exc: DiffuserveError) -> dict[str, Any] | None:
        """The error to record for job `job_id` whose generation ended with `exc`: the stopped error when the
        drain's deadline (or a second signal) answered it; None otherwise (the caller records `exc` itself)."""
        if self.stop_reason is not None and isinstance(exc, ServiceUnavailableError):
            self._stopped.add(job_id)
            return stopped_error(self.stop_reason)
        return None

    async def wait(self, deadline: float) -> None:
        """Until every tracked job has ended (encoded, written, recorded) or `deadline` (time.monotonic) passes."""
        while tasks := self._running():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.wait([driver.task for _, driver in tasks], timeout=left)

    def _running(self) -> list[tuple[str, _Driver]]:
        return [(job_id, driver) for job_id, driver in self._drivers.items() if not driver.task.done()]

    async def stop_rest(self) -> int:
        """At the drain's deadline: mark every job not ended yet (its generation was just answered with the drain's
        503, or it is still encoding or writing) as stopped by `stop_reason`. Returns how many jobs the drain
        stopped in all."""
        error = stopped_error(self.stop_reason or "the server stopped")
        rest = self._running()
        self._stopped.update(job_id for job_id, _ in rest)
        # All at once, and bounded: with the results store down each write retries for seconds (video_jobs.py).
        marks = {asyncio.ensure_future(run_in_threadpool(d.mark_stopped, error)): job_id for job_id, d in rest}
        if marks:
            done, late = await asyncio.wait(marks, timeout=MARK_TIMEOUT_S)
            unrecorded = [marks[task] for task in late] + [marks[task] for task in done if task.exception()]
            if unrecorded:
                logger.error(
                    "could not record %d job(s) as stopped by the drain (is the results store reachable?); after a "
                    "restart they read `interrupted`: %s",
                    len(unrecorded),
                    ", ".join(unrecorded),
                )
        return len(self._stopped)
