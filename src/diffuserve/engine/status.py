"""What the engine says about itself: its lifecycle state and one typed, frozen `EngineStatus` snapshot.

`AsyncEngine.status()` builds the snapshot in one place (`engine_status`, under the engine lock, once); /health,
/server_info, the remote engine's status message (`launch/engine_process.py`, pushed to the HTTP front end when
it changed) and the gauges /metrics mirrors (`EngineStatus.mirror_into`) all read it, so no route reaches into the
scheduler, the executor or the pipeline for it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from diffuserve.engine.metrics import EngineMetrics
from diffuserve.engine.request_book import RequestBook
from diffuserve.engine.scheduler_protocol import RequestScheduler
from diffuserve.errors import ServiceUnavailableError
from diffuserve.executor.base import ReplicaState
from diffuserve.family_spec.base import SamplingDefaults


class EngineState(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def not_ready_error(state: EngineState, failure: str | None) -> ServiceUnavailableError:
    """The 503 a request gets while the engine is in `state` (not READY); one wording for every engine client."""
    if state == EngineState.DRAINING:
        return ServiceUnavailableError("The server is shutting down and accepts no new requests.", retry_after_s=5)
    if state == EngineState.FAILED:
        return ServiceUnavailableError(f"The server is out of service: {failure}")
    return ServiceUnavailableError(
        f"The model is not ready yet ({state.value}); poll GET /health until it returns 200.",
        retry_after_s=5,
    )


JsonObject = dict[str, object]
"""A JSON object /server_info shows as it is (`Executor.describe()`, `ServingPipeline.describe()`); read-only by
convention (the status is a snapshot: nobody writes into it)."""


@dataclass(frozen=True)
class EngineStatus:
    """One snapshot of the engine, as /health, /server_info and the remote status message show it."""

    state: EngineState
    """The lifecycle state (DRAINING once a drain began)."""
    failure: str | None = None
    """Why the engine is out of service (FAILED), else None."""
    num_queued: int = 0
    """Requests waiting in the scheduler's queue (/server_info `queue.queued`)."""
    num_running: int = 0
    """Request-level batches running now (the continuous group's rows are `num_pending - num_queued` at most)."""
    num_pending: int = 0
    """Accepted requests not answered yet (queued or running)."""
    replicas: tuple[ReplicaState, ...] = ()
    """Copies of the executor's replica states (/server_info `replicas`)."""
    distributed: JsonObject | None = None
    """`Executor.describe()` (/server_info `distributed`; None for one process)."""
    adapters_in_use: tuple[str, ...] = ()
    """LoRA adapters named by the requests not answered yet, sorted."""
    pipeline: JsonObject | None = None
    """`ServingPipeline.describe()` once the model is loaded (/server_info `pipeline`)."""
    defaults: SamplingDefaults | None = None
    """The loaded model's `SamplingDefaults` (/server_info `defaults`)."""

    @property
    def ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def draining(self) -> bool:
        return self.state == EngineState.DRAINING

    def mirror_into(self, metrics: EngineMetrics) -> None:
        """Set the gauges of `metrics` that mirror this snapshot (queue depth, drain, each replica's state), so
        /metrics reads the same snapshot /health and /server_info do (refreshed when /metrics is scraped)."""
        metrics.set_queue_depth(self.num_queued)
        metrics.draining.set(int(self.draining))
        for replica in self.replicas:
            metrics.observe_replica(replica)


def engine_status(
    state: EngineState,
    failure: str | None,
    scheduler: RequestScheduler,
    book: RequestBook,
    replicas: list[ReplicaState],
    pipeline: JsonObject | None,
    defaults: SamplingDefaults | None,
    distributed: JsonObject | None,
) -> EngineStatus:
    """The snapshot `AsyncEngine.status()` returns; the caller holds the engine lock (and asked the pipeline and
    the executor for their descriptions before taking it: they take locks of their own)."""
    return EngineStatus(
        state=state,
        failure=failure,
        num_queued=scheduler.num_queued,
        num_running=scheduler.num_running,
        num_pending=len(book),
        replicas=tuple(dataclasses.replace(r) for r in replicas),
        distributed=distributed,
        adapters_in_use=book.adapters_in_use(),
        pipeline=pipeline,
        defaults=defaults,
    )
