"""What the routes of asynchronous jobs (/v1/videos, /v1/meshes) share: the error a job keeps, a job read brought
up to date from the engine's step counter, a cancel that also stops the engine's request, a list page, and the
cross-replica sync that stops the jobs another replica cancelled or deleted."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from diffuserve.errors import DiffuserveError, RequestCancelledError
from diffuserve.server.context import ServerContext
from diffuserve.server.job_store import Job, JobStore
from diffuserve.server.protocol import error_envelope

logger = logging.getLogger("diffuserve.server")
J = TypeVar("J", bound=Job)


def error_dict(exc: DiffuserveError) -> dict[str, Any]:
    """The `{message, type, param, code}` a failed or cancelled job keeps."""
    return error_envelope(exc.message, exc.error_type, exc.param, exc.code)["error"]


def refresh(ctx: ServerContext, store: JobStore[J], job: J) -> J:
    """Bring a live job's status and progress up to date from the engine's step counter."""
    if not job.terminal:
        progress = ctx.engine.progress(job.id)
        if progress is not None:
            store.set_progress(job.id, *progress)
    return job


def cancel(ctx: ServerContext, store: JobStore[J], job: J, how: str) -> None:
    """Cancel `job` (`how`: the route, for its error message) and, when that ended it, its engine request."""
    error = RequestCancelledError(f"The {store.kind} job was cancelled ({how}).")
    if store.cancel(job.id, error_dict(error)):
        # Queued: removed from the queue (it never runs). Running: stopped at the next step boundary
        # when no other request of its batch still waits, otherwise its row is dropped.
        ctx.engine.abort(job.id, error)


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of job objects as OpenAI lists them."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def stop_finished_elsewhere(ctx: ServerContext, store: JobStore[J], how: str) -> None:
    """Abort the jobs running here whose row another replica finished or deleted (`how`: swept | notified)."""
    for job_id in store.live_ids_finished_elsewhere():
        logger.info(
            "%s job %s was finished or deleted through another replica (%s); stopping it", store.kind, job_id, how
        )
        ctx.metrics.jobs_stopped_elsewhere.labels(kind=store.kind, how=how).inc()
        ctx.engine.abort(job_id, RequestCancelledError(f"The {store.kind} job {job_id} was cancelled or deleted."))


def sync_live_jobs(ctx: ServerContext, store: JobStore[J]) -> None:
    """After a results sweep: publish the progress of the jobs running here (for polls that reach another
    replica), then stop those another replica cancelled or deleted."""
    for job_id in store.live_ids():
        progress = ctx.engine.progress(job_id)
        if progress is not None:
            store.set_progress(job_id, *progress)
    stop_finished_elsewhere(ctx, store, "swept")


def stop_if_mine(ctx: ServerContext, store: JobStore[J], job_id: str) -> None:
    """Another replica finished or deleted `job_id` (PostgreSQL NOTIFY): if it runs here, stop it now (at its next
    step) rather than at the next sweep."""
    if job_id in store.live_ids():
        stop_finished_elsewhere(ctx, store, "notified")
