"""One store of asynchronous jobs (videos, meshes) over the results store (no engine, no HTTP here).

A job is created `queued`, becomes `in_progress` once its first step is reported, and ends `completed` (with its
file), `failed` (with an error in the envelope shape) or `cancelled`; a finished job never changes again. Jobs are
rows of one `kind` in the results store (storage/results.py, used only through its public methods), so they survive
a restart and are seen by every process sharing it. The jobs this process runs are also kept as objects in memory
(progress is updated at every poll and written through). Past `max_jobs` rows the oldest *finished* jobs (and their
files) are dropped first; live ones never are. A cancel or delete sent to another replica finishes or removes the
row; the process running the job finds that (`live_ids_finished_elsewhere`) and stops it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Generic, Protocol, TypeVar

from diffuserve.storage import Record, ResultStore

QUEUED = "queued"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL_STATUSES = frozenset({COMPLETED, FAILED, CANCELLED})
"""Statuses a job never leaves."""


class Job(Protocol):
    """What the store needs of a job dataclass (VideoJob, MeshJob)."""

    id: str
    status: str
    progress: int
    error: dict[str, Any] | None
    completed_at: int | None
    created_at: int
    runner: Any

    @property
    def terminal(self) -> bool: ...

    @property
    def file_name(self) -> str: ...

    def meta(self) -> dict[str, Any]: ...


J = TypeVar("J", bound=Job)


class JobStore(Generic[J]):
    """Jobs of one kind by id, newest first; thread-safe; bounded by `max_jobs` rows (live ones always kept)."""

    def __init__(self, results: ResultStore, max_jobs: int, *, kind: str, job_type: Any):
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.results = results
        self.max_jobs = max_jobs
        self.kind = kind
        """The results rows' kind (`video`, `mesh`)."""
        self._job_type = job_type
        """The job dataclass; its `from_record` rebuilds a job from a row."""
        self._live: dict[str, J] = {}
        """Jobs of this process that have not finished (the object the runner task updates)."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.results.count(self.kind)

    def _from_record(self, record: Record) -> J:
        job: J = self._job_type.from_record(record)
        return job

    def add(self, job: J) -> list[str]:
        """Keep `job`; returns the ids of the finished jobs dropped to stay within `max_jobs`."""
        with self._lock:
            if job.id in self._live or self.results.get(job.id) is not None:
                raise KeyError(f"duplicate {self.kind} job id {job.id!r}")
            self.results.add(job.id, self.kind, job.status, job.meta(), created_at=job.created_at)
            self._live[job.id] = job
        return self.results.evict(self.kind, self.max_jobs)

    def get(self, job_id: str) -> J | None:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
        record = self.results.get(job_id)
        return self._from_record(record) if record is not None and record.kind == self.kind else None

    def list(self, *, limit: int = 20, after: str | None = None, newest_first: bool = True) -> tuple[list[J], bool]:
        """Jobs newest (or oldest) first, starting after the job `after` (a cursor); returns (page, has_more).

        Raises KeyError when `after` is not a kept job.
        """
        records, has_more = self.results.list(self.kind, limit=limit, after=after, newest_first=newest_first)
        with self._lock:
            page = [self._live.get(r.id) or self._from_record(r) for r in records]
        return page, has_more

    def content(self, job: J) -> bytes | None:
        """The file of a completed job (None otherwise, or when its file is gone)."""
        record = self.results.get(job.id)
        if record is None or record.status != COMPLETED:
            return None
        return self.results.read_file(record, job.file_name)

    def presign(self, job: J, expires_s: int) -> str | None:
        """A presigned URL of a completed job's file in the media store (None where it cannot sign)."""
        record = self.results.get(job.id)
        if record is None or record.status != COMPLETED:
            return None
        return self.results.presign(record, job.file_name, expires_s)

    def remove(self, job_id: str) -> J | None:
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
        gone = []
        for job_id in self.live_ids():
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
            # 100 is kept for "completed": decoding and encoding the file still follow the last step.
            share = int(100 * steps_done / num_steps) if num_steps > 0 else 0
            progress = max(job.progress, min(99, share))
            changed = job.status != IN_PROGRESS or progress != job.progress
            job.status, job.progress = IN_PROGRESS, progress
            meta = job.meta()
        if changed:
            self.results.update_live(job_id, status=IN_PROGRESS, meta=meta)
        return True

    def finish(
        self,
        job_id: str,
        status: str,
        *,
        error: dict[str, Any] | None = None,
        content: bytes | None = None,
        **fields: Any,
    ) -> bool:
        """Move a job to the terminal `status`, with `fields` (e.g. `timings`) set and `content` as its file."""
        with self._lock:
            job = self._live.get(job_id)
        if job is None:
            # Not running here: a job of another (live) process, or already finished.
            record = self.results.get(job_id)
            if record is None or not record.live:
                return False
            job = self._from_record(record)
        if job.terminal:
            return False
        final = dataclasses.replace(job, status=status, runner=None, **fields)  # type: ignore[type-var]
        if error is not None:
            final.error = error
        if status == COMPLETED:
            final.progress = 100
        files = {job.file_name: content} if content is not None else None
        if not self._finish_row(job_id, status, final.meta(), files):
            with self._lock:
                self._live.pop(job_id, None)
            return False
        record = self.results.get(job_id)
        with self._lock:
            self._live.pop(job_id, None)
            job.__dict__.update({k: v for k, v in final.__dict__.items() if k != "runner"})
            job.completed_at = int(record.completed_at or time.time()) if record is not None else int(time.time())
            if record is not None and hasattr(job, "expires_at"):
                job.expires_at = None if record.expires_at is None else int(record.expires_at)
        return True

    def _finish_row(self, job_id: str, status: str, meta: dict[str, Any], files: dict[str, bytes] | None) -> bool:
        """Write the finished row (a subclass may retry while the store is unavailable)."""
        return self.results.finish(job_id, status, meta, files)

    def complete(self, job_id: str, content: bytes, timings: dict[str, Any], **fields: Any) -> bool:
        return self.finish(job_id, COMPLETED, content=content, timings=timings, **fields)

    def fail(self, job_id: str, error: dict[str, Any]) -> bool:
        return self.finish(job_id, FAILED, error=error)

    def cancel(self, job_id: str, error: dict[str, Any] | None = None) -> bool:
        return self.finish(job_id, CANCELLED, error=error)
