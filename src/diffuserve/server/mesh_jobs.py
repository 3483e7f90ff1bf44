"""The store of asynchronous mesh jobs behind `/v1/meshes` (no engine, no HTTP here).

A job is `queued`, then `in_progress` once its first DiT step is reported, and ends `completed` (with its GLB or
OBJ file), `failed` or `cancelled`. Jobs are rows of kind `mesh` in the results store, kept by the shared job
store (the `server.job_store` module, which says how rows are kept, dropped and stopped across replicas); a process
takes no more than `max_jobs` unfinished mesh jobs (`check_room`: 429).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from diffuserve.errors import QueueFullError
from diffuserve.server.job_store import QUEUED, TERMINAL_STATUSES, JobStore
from diffuserve.storage import Record, ResultStore

KIND = "mesh"


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
    status: str = QUEUED
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
        return self.status in TERMINAL_STATUSES

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


class MeshJobStore(JobStore[MeshJob]):
    """Mesh jobs by id, newest first; thread-safe; bounded by `max_jobs` rows (live ones always kept)."""

    def __init__(self, results: ResultStore, max_jobs: int = 128):
        super().__init__(results, max_jobs, kind=KIND, job_type=MeshJob)

    def check_room(self) -> None:
        """Raise TooManyMeshJobsError when `max_jobs` jobs of this process are unfinished (none could be dropped
        to keep the new one within the cap)."""
        live = len(self.live_ids())
        if live >= self.max_jobs:
            raise TooManyMeshJobsError(
                f"This server already has {live} mesh jobs queued or running (--max-mesh-jobs {self.max_jobs}); "
                "retry once one finishes, or cancel one.",
                retry_after_s=1.0,
            )
