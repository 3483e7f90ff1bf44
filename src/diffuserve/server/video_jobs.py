"""The in-memory store of asynchronous video jobs behind `/v1/videos` (no engine, no HTTP here).

A job is created `queued`, becomes `in_progress` once its first denoising step is reported, and ends
`completed` (with its MP4 bytes), `failed` (with an error in the envelope shape) or `cancelled`.
A finished job never changes again: a late result of a cancelled job is dropped, a late cancel of a
completed job is refused by the route. The store is bounded: past `max_jobs`, the oldest *finished*
jobs (and their bytes) are dropped first; running and queued jobs are never dropped, since their
number is already bounded by the engine's queue.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

QUEUED = "queued"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL_STATUSES = frozenset({COMPLETED, FAILED, CANCELLED})
"""Statuses a job never leaves."""


@dataclass
class VideoJob:
    """One video job: what was asked, where it stands, and (once completed) the encoded MP4."""

    id: str
    """Server-generated id (`video_<hex>`); also the engine's request id, for progress and abort."""
    model: str
    """Public model name the job was served under."""
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    seed: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    """Unix seconds at creation."""
    status: str = QUEUED
    """queued | in_progress | completed | failed | cancelled."""
    progress: int = 0
    """0-100: the share of denoising steps done; 100 only once completed."""
    completed_at: int | None = None
    """Unix seconds when the job reached a terminal status."""
    error: dict[str, Any] | None = None
    """`{message, type, param, code}` when failed (or cancelled)."""
    timings: dict[str, Any] | None = None
    """queue_wait_ms, inference_ms, encode_ms, total_ms, batch_size, stages_ms once completed."""
    content: bytes | None = field(default=None, repr=False)
    """The MP4 once completed."""
    runner: Any = field(default=None, repr=False, compare=False)
    """The asyncio task that drives the job (kept referenced so it is not garbage-collected)."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def seconds(self) -> str:
        """Duration as OpenAI reports it (a string), e.g. "5.0625" for 81 frames at 16 fps."""
        return f"{self.num_frames / self.fps:g}"

    def to_dict(self) -> dict[str, Any]:
        """The public job object (OpenAI's video object plus our frame, seed and timing fields)."""
        return {
            "id": self.id,
            "object": "video",
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": None,
            "model": self.model,
            "prompt": self.prompt,
            "size": f"{self.width}x{self.height}",
            "seconds": self.seconds,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "num_inference_steps": self.num_inference_steps,
            "seed": self.seed,
            "error": self.error,
            "timings": self.timings,
        }


class VideoJobStore:
    """Jobs by id in creation order; thread-safe; bounded by `max_jobs` finished-or-not jobs."""

    def __init__(self, max_jobs: int = 128):
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.max_jobs = max_jobs
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def add(self, job: VideoJob) -> list[str]:
        """Keep `job`; returns the ids of the finished jobs dropped to stay within `max_jobs`."""
        with self._lock:
            if job.id in self._jobs:
                raise KeyError(f"duplicate video job id {job.id!r}")
            self._jobs[job.id] = job
            dropped: list[str] = []
            excess = len(self._jobs) - self.max_jobs
            for old in list(self._jobs.values()):
                if excess <= 0:
                    break
                if old.terminal and old.id != job.id:
                    del self._jobs[old.id]
                    dropped.append(old.id)
                    excess -= 1
            return dropped

    def get(self, job_id: str) -> VideoJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def list(self, *, limit: int = 20, after: str | None = None) -> tuple[list[VideoJob], bool]:
        """Jobs newest first, starting after the job `after` (a cursor); returns (page, has_more).

        Raises KeyError when `after` is not a kept job.
        """
        with self._lock:
            newest_first = list(reversed(self._jobs.values()))
        start = 0
        if after is not None:
            ids = [job.id for job in newest_first]
            if after not in ids:
                raise KeyError(after)
            start = ids.index(after) + 1
        page = newest_first[start:start + limit]
        return page, start + limit < len(newest_first)

    def remove(self, job_id: str) -> VideoJob | None:
        with self._lock:
            return self._jobs.pop(job_id, None)

    # -- transitions (each returns False when the job is unknown or already finished) -------------

    def set_progress(self, job_id: str, steps_done: int, num_steps: int) -> bool:
        """A running job reported `steps_done` of `num_steps`: in_progress, progress never goes back."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.terminal:
                return False
            job.status = IN_PROGRESS
            # 100 is kept for "completed": decode and MP4 encoding still follow the last step.
            share = int(100 * steps_done / num_steps) if num_steps > 0 else 0
            job.progress = max(job.progress, min(99, share))
            return True

    def complete(self, job_id: str, content: bytes, timings: dict[str, Any]) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.terminal:
                return False
            job.status, job.progress, job.content, job.timings = COMPLETED, 100, content, timings
            job.completed_at = int(time.time())
            return True

    def fail(self, job_id: str, error: dict[str, Any]) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.terminal:
                return False
            job.status, job.error, job.completed_at = FAILED, error, int(time.time())
            return True

    def cancel(self, job_id: str, error: dict[str, Any] | None = None) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.terminal:
                return False
            job.status, job.error, job.completed_at = CANCELLED, error, int(time.time())
            return True
