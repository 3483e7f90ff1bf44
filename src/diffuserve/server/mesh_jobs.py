"""The store of asynchronous mesh jobs behind `/v1/meshes` (no engine, no HTTP here).

A job is `queued`, then `in_progress` once its first DiT step is reported, and ends `completed` (with its GLB or
OBJ file), `failed` or `cancelled`; a finished job never changes again. Jobs are rows of kind `mesh` in the
results store (storage/results.py, used only through its public methods), so they survive a restart and are seen
by every process sharing it. Past `max_jobs` rows the oldest finished jobs are dropped first, and a process
takes no more than `max_jobs` unfinished jobs (`check_room`: 429). A cancel or delete sent to another replica
finishes or removes the row; the process running the job finds that (`live_ids_finished_elsewhere`) and stops it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from diffuserve.errors import QueueFullError
from diffuserve.storage import Record, ResultStore

KIND = "mesh"
TERMINAL = frozenset({"completed", "failed", "cancelled"})


@dataclass
class MeshJob:
    """One image-to-3D job."""

    id: str
    """`mesh_<hex>`; also the engine's request id (progress, abort)."""
    model: str
    """Public model name."""
    seed: int
    num_inference_steps: int
    guidance_scale: float
    octree_resolution: int
    output_format: str
    """glb | obj."""
    prompt: str = ""
    """Accepted and ignored, as SGLang does (the image conditions the shape)."""
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    """queued | in_progress | completed | failed | cancelled."""
    progress: int = 0
    """0-100 share of DiT steps done; 100 only once completed."""
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    """`{message, type, param, code}` when failed or cancelled."""
    timings: dict[str, Any] | None = None
    """queue_wait_ms, inference_ms, encode_ms, total_ms, batch_size, stages_ms once completed."""
    num_vertices: int | None = None
    num_faces: int | None = None
    runner: Any = field(default=None, repr=False, compare=False)
    """The asyncio task driving the job."""

    _META = (
        "model",
        "seed",
        "num_inference_steps",
        "guidance_scale",
        "octree_resolution",
        "output_format",
        "prompt",
        "progress",
        "error",
        "timings",
        "num_vertices",
        "num_faces",
    )

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def file_name(self) -> str:
        return f"mesh.{self.output_format}"

    def meta(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._META}

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "mesh",
            "status": self.status,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            **{k: v for k, v in self.meta().items()},
        }

    @classmethod
    def from_record(cls, record: Record) -> MeshJob:
        meta = {k: v for k, v in record.meta.items() if k in cls._META}
        return cls(
            id=record.id,
            status=record.status,
            created_at=int(record.created_at),
            completed_at=None if record.completed_at is None else int(record.completed_at),
            **meta,
        )


class TooManyMeshJobsError(QueueFullError):
    """A create while this process already has --max-mesh-jobs jobs queued or running."""

    code = "too_many_mesh_jobs"


class MeshJobStore:
    """Mesh jobs by id, newest first; thread-safe; bounded by `max_jobs` rows (live ones always kept)."""

    def __init__(self, results: ResultStore, max_jobs: int = 128):
        self.results = results
        self.max_jobs = max_jobs
        self._live: dict[str, MeshJob] = {}
        self._lock = threading.Lock()

    def check_room(self) -> None:
        """Raise TooManyMeshJobsError when `max_jobs` jobs of this process are unfinished (none could be dropped
        to keep the new one within the cap)."""
        with self._lock:
            live = len(self._live)
        if live >= self.max_jobs:
            raise TooManyMeshJobsError(
                f"This server already has {live} mesh jobs queued or running (--max-mesh-jobs {self.max_jobs}); "
                "retry once one finishes, or cancel one.",
                retry_after_s=1.0,
            )

    def live_ids(self) -> list[str]:
        """Ids of the jobs this process runs or has queued."""
        with self._lock:
            return list(self._live)

    def live_ids_finished_elsewhere(self) -> list[str]:
        """Jobs this process runs whose row another process finished or deleted (a cancel or delete sent to
        another replica); they are forgotten here and returned so the caller can abort them."""
        gone = []
        for job_id in self.live_ids():
            record = self.results.get(job_id)
            if record is None or not record.live:
                gone.append(job_id)
        with self._lock:
            for job_id in gone:
                self._live.pop(job_id, None)
        return gone

    def add(self, job: MeshJob) -> None:
        with self._lock:
            self.results.add(job.id, KIND, job.status, job.meta(), created_at=job.created_at)
            self._live[job.id] = job
        self.results.evict(KIND, self.max_jobs)

    def get(self, job_id: str) -> MeshJob | None:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
        record = self.results.get(job_id)
        return MeshJob.from_record(record) if record is not None and record.kind == KIND else None

    def list(self, *, limit: int, after: str | None, newest_first: bool) -> tuple[list[MeshJob], bool]:
        """A page of jobs; KeyError when `after` is not a kept job."""
        records, has_more = self.results.list(KIND, limit=limit, after=after, newest_first=newest_first)
        with self._lock:
            return [self._live.get(r.id) or MeshJob.from_record(r) for r in records], has_more

    def content(self, job: MeshJob) -> bytes | None:
        record = self.results.get(job.id)
        if record is None or record.status != "completed":
            return None
        return self.results.read_file(record, job.file_name)

    def remove(self, job_id: str) -> None:
        with self._lock:
            self._live.pop(job_id, None)
        self.results.delete(job_id)

    def set_progress(self, job_id: str, steps_done: int, num_steps: int) -> None:
        with self._lock:
            job = self._live.get(job_id)
            if job is None or job.terminal:
                return
            progress = max(job.progress, min(99, int(100 * steps_done / max(num_steps, 1))))
            changed = job.status != "in_progress" or progress != job.progress
            job.status, job.progress = "in_progress", progress
            meta = job.meta()
        if changed:
            self.results.update_live(job_id, status="in_progress", meta=meta)

    def finish(
        self,
        job_id: str,
        status: str,
        *,
        error: dict[str, Any] | None = None,
        content: bytes | None = None,
        **fields: Any,
    ) -> bool:
        """Move a live job to a terminal status (False when unknown or already finished)."""
        with self._lock:
            job = self._live.get(job_id)
        if job is None:
            record = self.results.get(job_id)
            if record is None or not record.live:
                return False
            job = MeshJob.from_record(record)
        if job.terminal:
            return False
        final = MeshJob(**{**job.__dict__, "status": status, "runner": None, **fields})
        final.error = error if error is not None else final.error
        if status == "completed":
            final.progress = 100
        files = {job.file_name: content} if content is not None else None
        ok = self.results.finish(job_id, status, final.meta(), files)
        record = self.results.get(job_id)
        with self._lock:
            self._live.pop(job_id, None)
            if ok:
                job.__dict__.update({k: v for k, v in final.__dict__.items() if k != "runner"})
                job.completed_at = int(record.completed_at) if record and record.completed_at else int(time.time())
        return ok
