"""The store of asynchronous video jobs behind `/v1/videos` (no engine, no HTTP here).

A job is created `queued`, becomes `in_progress` once its first denoising step is reported, and ends
`completed` (with its MP4), `failed` (with an error in the envelope shape) or `cancelled`. A finished
job never changes again: a late result of a cancelled job is dropped, a late cancel of a completed job
is refused by the route.

Jobs are rows of kind `video` in the results store, kept by the shared job store (the `server.job_store` module), so
they survive a restart and are seen by every process sharing its stores (--output-dir, or --results-db and --media-store
across hosts); the MP4 is a file or object there. Running and queued jobs are never dropped past `max_jobs`, since
their number is already bounded by the engine's queue. Recording a finished video retries while the results store
is unavailable (FINISH_RETRIES_S).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from diffuserve.server.job_store import QUEUED, TERMINAL_STATUSES, JobStore
from diffuserve.storage import Record, ResultStore
from diffuserve.storage.media import StoreUnavailableError

VIDEO_FILE = "video.mp4"
"""Name of a completed job's MP4 inside its results folder."""


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
    def file_name(self) -> str:
        return VIDEO_FILE

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


class VideoJobStore(JobStore[VideoJob]):
    """Video jobs by id, newest first; thread-safe; bounded by `max_jobs` rows (live ones always kept)."""

    def __init__(self, results: ResultStore, max_jobs: int = 128):
        super().__init__(results, max_jobs, kind="video", job_type=VideoJob)

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
