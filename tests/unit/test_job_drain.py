"""The drain's side of asynchronous jobs (server/job_drain.py) on a real SQLite store: the drain waits for job
drivers, a job its deadline cut is recorded `shutdown` (never `interrupted`), a finished job is left alone."""

from __future__ import annotations

import asyncio
import threading
import time

from diffuserve.errors import GenerationError, ServiceUnavailableError
from diffuserve.server.job_drain import STOPPED_CODE, JobDrivers
from diffuserve.server.video_jobs import VideoJob, VideoJobStore
from diffuserve.storage import ResultStore
from tests.conftest import log_messages


def _job(i: int) -> VideoJob:
    return VideoJob(
        id=f"video_{i}", model="m", prompt="p", width=32, height=32, num_frames=5, fps=8, num_inference_steps=4, seed=i
    )


def test_only_the_drains_503_reads_as_stopped():
    drivers = JobDrivers()
    drained = ServiceUnavailableError("The server shut down before this request finished; retry.")
    assert drivers.failure("video_1", drained) is None, "not draining: the caller records the error as it is"
    drivers.stop_reason = "its deadline, --shutdown-timeout-s 2, passed"
    error = drivers.failure("video_1", drained)
    assert error is not None and error["code"] == STOPPED_CODE and error["type"] == "server_error"
    assert "stopped during a graceful drain" in error["message"] and "--shutdown-timeout-s 2" in error["message"]
    assert drivers.failure("video_2", GenerationError("boom")) is None, "a failed batch stays generation_failed"


def test_the_drain_waits_for_drivers_then_marks_the_rest_stopped(tmp_path):
    store = VideoJobStore(ResultStore(tmp_path / "results"), 8)

    async def main() -> tuple[int, float]:
        drivers = JobDrivers()
        encoded = asyncio.Event()

        async def finishes() -> None:  # encodes, then records its MP4 (the drain must wait for this)
            await encoded.wait()
            store.complete("video_1", b"mp4", {})

        async def never() -> None:  # still encoding at the deadline
            await asyncio.Event().wait()

        for i, body in ((1, finishes), (2, never)):
            store.add(_job(i))
            drivers.track(f"video_{i}", asyncio.ensure_future(body()), lambda e, i=i: store.fail(f"video_{i}", e))
        assert len(drivers) == 2
        asyncio.get_running_loop().call_later(0.05, encoded.set)
        drivers.stop_reason = "its deadline, --shutdown-timeout-s 0.3, passed"
        started = time.monotonic()
        await drivers.wait(started + 0.3)
        waited = time.monotonic() - started
        return await drivers.stop_rest(), waited

    stopped, waited = asyncio.run(main())
    assert stopped == 1 and 0.3 <= waited < 5
    assert store.get("video_1").status == "completed" and store.content(store.get("video_1")) == b"mp4"
    cut = store.get("video_2")
    assert cut.status == "failed" and cut.error["code"] == "shutdown" and "0.3" in cut.error["message"]


def test_a_results_store_that_does_not_answer_does_not_hold_the_exit(monkeypatch, caplog):
    """Rows that cannot be written (the store is down: a write raises, or its retries hang) are named by id in the
    server's output,
    and the drain goes on after MARK_TIMEOUT_S rather than once per job."""
    from diffuserve.server import job_drain

    monkeypatch.setattr(job_drain, "MARK_TIMEOUT_S", 0.2)
    release = threading.Event()

    def down(_error) -> None:
        raise ConnectionError("store down")

    async def main() -> tuple[int, float]:
        drivers = JobDrivers()
        for job_id, mark in (("video_1", down), ("video_2", lambda _e: release.wait(30)), ("video_3", down)):
            drivers.track(job_id, asyncio.ensure_future(asyncio.Event().wait()), mark)
        started = time.monotonic()
        stopped = await drivers.stop_rest()
        return stopped, time.monotonic() - started

    try:
        stopped, took = asyncio.run(main())
    finally:
        release.set()
    assert stopped == 3 and took < 5, took
    messages = "\n".join(log_messages(caplog))
    assert "could not record 3 job(s) as stopped" in messages and "video_2" in messages, messages
