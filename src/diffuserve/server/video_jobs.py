"""The store of asynchronous video jobs behind `/v1/videos` (no engine, no HTTP here).

A job is created `queued`, becomes `in_progress` once its first denoising step is reported, and ends
`completed` (with its MP4), `failed` (with an error in the envelope shape) or `cancelled`. A finished
job never changes again: a late result of a cancelled job is dropped, a late cancel of a completed job
is refused by the route.

Jobs are rows of the results store (storage/results.py), so they survive a restart and are seen by
every process sharing its stores (--output-dir, or --results-db and --media-store across hosts); the MP4
is a file or object there. The jobs this process is running are
also kept as objects in memory (progress is updated at every poll and written through). Past
`max_jobs` rows, the oldest *finished* jobs (and their files) are dropped first; running and queued
jobs never are, since their number is already bounded by the engine's queue.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from diffuserve.storage import Record, ResultStore
from diffuserve.storage.media import StoreUnavailableError

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
    negative_prompt: str | None = None
    """The request's negative prompt (kept so a remix repeats it)."""
    guidance_scale: float | None = None
    """The request's guidance scale (None: the model's default)."""
    guidance_scale_2: float | None = None
    """Wan2.2 A14B: the request's low-noise expert guidance (None: the default), kept for a remix."""
    boundary_ratio: float | None = None
    """Wan2.2 A14B: the request's expert boundary (None: the checkpoint's), kept for a remix."""
    true_cfg_scale: float | None = None
    """The request's true CFG scale (None: the default), kept for a remix."""
    flow_shift: float | None = None
    """The request's scheduler shift (None: the checkpoint's), kept for a remix."""
    generate_audio: bool | None = None
    """Models with sound: whether the job's MP4 carries it (None: the model makes none), kept for a remix."""
    has_input_reference: bool = False
    """The job was conditioned on an input image (not kept, so such a job cannot be remixed)."""
    remixed_from_video_id: str | None = None
    """The job this one remixes (POST /v1/videos/{id}/remix), as OpenAI reports it."""
    created_at: int = field(default_factory=lambda: int(time.time()))
    """Unix seconds at creation."""
    status: str = QUEUED
    """queued | in_progress | completed | failed | cancelled."""
    progress: int = 0
    """0-100: the share of denoising steps done; 100 only once completed."""
    completed_at: int | None = None
    """Unix seconds when the job reached a terminal status."""
    expires_at: int | None = None
    """Unix seconds after which the retention sweep removes the job (--result-ttl-s); None while live or kept
    forever."""
    error: dict[str, Any] | None = None
    """`{message, type, param, code}` when failed (or cancelled)."""
    timings: dict[str, Any] | None = None
    """queue_wait_ms, inference_ms, encode_ms, total_ms, batch_size, stages_ms once completed."""
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
            "expires_at": self.expires_at,
            "model": self.model,
            "prompt": self.prompt,
            "size": f"{self.width}x{self.height}",
            "seconds": self.seconds,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "num_inference_steps": self.num_inference_steps,
            "seed": self.seed,
            "remixed_from_video_id": self.remixed_from_video_id,
            "error": self.error,
            "timings": self.timings,
        }

    _META = (
        "model",
        "prompt",
        "width",
        "height",
        "num_frames",
        "fps",
        "num_inference_steps",
        "seed",
        "negative_prompt",
        "guidance_scale",
        "guidance_scale_2",
        "boundary_ratio",
        "true_cfg_scale",
        "flow_shift",
        "generate_audio",
        "has_input_reference",
        "remixed_from_video_id",
        "progress",
        "error",
        "timings",
    )

    def meta(self) -> dict[str, Any]:
        """What the results row keeps besides its id, status and times."""
        return {name: getattr(self, name) for name in self._META}

    @classmethod
    def from_record(cls, record: Record) -> VideoJob:
        meta = {k: v for k, v in record.meta.items() if k in cls._META}
        return cls(
            id=record.id,
            status=record.status,
            created_at=int(record.created_at),
            completed_at=None if record.completed_at is None else int(record.completed_at),
            expires_at=None if record.expires_at is None else int(record.expires_at),
            **meta,
        )


FINISH_RETRIES_S = (1.0, 2.0, 4.0, 8.0)
"""Waits between attempts to record a finished job while the results store is unavailable."""

VIDEO_FILE = "video.mp4"
"""Name of a completed job's MP4 inside its results folder."""


class VideoJobStore:
    """Jobs by id, newest first; thread-safe; bounded by `max_jobs` rows (live ones always kept)."""

    def __init__(self, results: ResultStore, max_jobs: int = 128):
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.results = results
        self.max_jobs = max_jobs
        self._live: dict[str, VideoJob] = {}
        """Jobs of this process that have not finished (the object the runner task updates)."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.results.count("video")

    def add(self, job: VideoJob) -> list[str]:
        """Keep `job`; returns the ids of the finished jobs dropped to stay within `max_jobs`."""
        with self._lock:
            if job.id in self._live or self.results.get(job.id) is not None:
                raise KeyError(f"duplicate video job id {job.id!r}")
            self.results.add(job.id, "video", job.status, job.meta(), created_at=job.created_at)
            self._live[job.id] = job
        return self.results.evict("video", self.max_jobs)

    def get(self, job_id: str) -> VideoJob | None:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
        record = self.results.get(job_id)
        return VideoJob.from_record(record) if record is not None and record.kind == "video" else None

    def list(
        self, *, limit: int = 20, after: str | None = None, newest_first: bool = True
    ) -> tuple[list[VideoJob], bool]:
        """Jobs newest (or oldest) first, starting after the job `after` (a cursor); returns (page, has_more).

        Raises KeyError when `after` is not a kept job.
        """
        records, has_more = self.results.list("video", limit=limit, after=after, newest_first=newest_first)
        with self._lock:
            page = [self._live.get(r.id) or VideoJob.from_record(r) for r in records]
        return page, has_more

    def content(self, job: VideoJob) -> bytes | None:
        """The MP4 of a completed job (None otherwise, or when its file is gone)."""
        record = self.results.get(job.id)
        if record is None or record.status != COMPLETED:
            return None
        return self.results.read_file(record, VIDEO_FILE)

    def presign(self, job: VideoJob, expires_s: int) -> str | None:
        """A presigned URL of a completed job's MP4 in the media store (None where it cannot sign)."""
        record = self.results.get(job.id)
        if record is None or record.status != COMPLETED:
            return None
        return self.results.presign(record, VIDEO_FILE, expires_s)

    def remove(self, job_id: str) -> VideoJob | None:
        job = self.get(job_id)
        with self._lock:
            self._live.pop(job_id, None)
        self.results.delete(job_id)
        return job

    def live_ids(self) -> list[str]:
        """Ids of the jobs this process is running or has queued."""
        with self._lock:
            return list(self._live)

    def live_ids_finished_elsewhere(self) -> list[str]:
        """Jobs this process runs whose row another process finished or deleted (a cancel or delete
        sent to another replica); they are forgotten here and returned so the caller can abort them."""
        with self._lock:
            ids = list(self._live)
        gone = []
        for job_id in ids:
            record = self.results.get(job_id)
            if record is None or not record.live:
                gone.append(job_id)
        with self._lock:
            for job_id in gone:
                self._live.pop(job_id, None)
        return gone

    # -- transitions (each returns False when the job is unknown or already finished) -------------

    def set_progress(self, job_id: str, steps_done: int, num_steps: int) -> bool:
        """A running job reported `steps_done` of `num_steps`: in_progress, progress never goes back."""
        with self._lock:
            job = self._live.get(job_id)
            if job is None or job.terminal:
                return False
            # 100 is kept for "completed": decode and MP4 encoding still follow the last step.
            share = int(100 * steps_done / num_steps) if num_steps > 0 else 0
            progress = max(job.progress, min(99, share))
            changed = job.status != IN_PROGRESS or progress != job.progress
            job.status, job.progress = IN_PROGRESS, progress
            meta = job.meta()
        if changed:
            self.results.update_live(job_id, status=IN_PROGRESS, meta=meta)
        return True

    def _finish(
        self,
        job_id: str,
        status: str,
        *,
        error: dict[str, Any] | None = None,
        content: bytes | None = None,
        timings: dict[str, Any] | None = None,
    ) -> bool:
        with self._lock:
            job = self._live.get(job_id)
        if job is None:
            # Not running here: a job of another (live) process, or already finished.
            record = self.results.get(job_id)
            if record is None or not record.live:
                return False
            job = VideoJob.from_record(record)
        if job.terminal:
            return False
        final = VideoJob(**{**job.__dict__, "status": status, "runner": None})
        if error is not None:
            final.error = error
        if status == COMPLETED:
            final.progress, final.timings = 100, timings
        files = {VIDEO_FILE: content} if content is not None else None
        if not self._finish_row(job_id, status, final.meta(), files):
            with self._lock:
                self._live.pop(job_id, None)
            return False
        record = self.results.get(job_id)
        with self._lock:
            self._live.pop(job_id, None)
            job.status, job.progress, job.error, job.timings = final.status, final.progress, final.error, final.timings
            if record is not None:
                job.completed_at = int(record.completed_at or time.time())
                job.expires_at = None if record.expires_at is None else int(record.expires_at)
        return True

    def _finish_row(self, job_id: str, status: str, meta: dict[str, Any], files: dict[str, bytes] | None) -> bool:
        """`results.finish`, retried while the store is unavailable (FINISH_RETRIES_S): a finished video is
        kept in memory meanwhile, and recorded once the store answers again (else the error propagates)."""
        for wait_s in (*FINISH_RETRIES_S, None):
            try:
                return self.results.finish(job_id, status, meta, files)
            except StoreUnavailableError:
                if wait_s is None:
                    raise
                time.sleep(wait_s)
        raise AssertionError("unreachable")

    def complete(self, job_id: str, content: bytes, timings: dict[str, Any]) -> bool:
        return self._finish(job_id, COMPLETED, content=content, timings=timings)

    def fail(self, job_id: str, error: dict[str, Any]) -> bool:
        return self._finish(job_id, FAILED, error=error)

    def cancel(self, job_id: str, error: dict[str, Any] | None = None) -> bool:
        return self._finish(job_id, CANCELLED, error=error)
