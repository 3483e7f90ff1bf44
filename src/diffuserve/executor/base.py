"""The engine's side of the seam: `Executor`, and the one-rank `InProcessExecutor`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from diffuserve.executor.worker import BatchOutcome, PreviewSink, Request, run_batch
from diffuserve.pipelines.base import Pipeline
from diffuserve.sampling import SamplingParams


@dataclass
class ReplicaState:
    """What /metrics and /server_info show of one replica."""

    replica: int
    """Replica index (0 .. dp_size - 1)."""
    ranks: tuple[int, ...]
    """Global ranks of the replica (its leader first)."""
    busy: bool = False
    """A batch is running on it now."""
    batches: int = 0
    """Batches it has run."""
    rows: int = 0
    """Output rows it has produced."""
    failed: str | None = None
    """Why it is out of service (a rank fault); None while healthy."""


@dataclass
class BatchCall:
    """One execute() request: the batch and the engine's hooks for it (the hooks stay on rank 0)."""

    requests: Sequence[Request]
    """The batch's requests, in order (their cancel events are read at step boundaries)."""
    on_step: Callable[[int, int], None] | None = None
    """Progress and deadline hook, called after each denoising step."""
    previews: dict[str, PreviewSink] = field(default_factory=dict)
    """Streaming requests' preview sinks."""
    max_rows: int | None = None
    """Row cap of every pipeline call (dynamic mode); None = one call."""
    on_decoded: Callable[[BatchOutcome], None] | None = None
    """Decode overlap (`run_batch`): the batch's decode may run in the decode lane while the engine goes on; the
    complete outcome then comes here from that lane (the returned one is `deferred`). An executor that cannot
    defer ignores it and returns the complete outcome."""


class StepRunner(Protocol):
    """Continuous batching's three moves, on every rank of replica 0: start the requests joining at one boundary
    (shared encoder calls; each gets its `pipelines.step_batch.RequestRows`, or the exception that failed it
    alone), step the group, drop a request that left. Start may run in the encode lane's thread."""

    def start(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[Any]: ...

    def step(self, rows: Sequence[tuple[str, Any]]) -> None: ...

    def drop(self, request_id: str) -> None: ...


class LocalSteps:
    """StepRunner of one rank: the step_batch pieces on this process's pipeline."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    def start(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[Any]:
        from diffuserve.pipelines import step_batch

        return step_batch.start_group(self.pipeline, [params for _, params in requests])  # type: ignore[arg-type]

    def step(self, rows: Sequence[tuple[str, Any]]) -> None:
        from diffuserve.pipelines import step_batch

        step_batch.denoise_step(self.pipeline, [state for _, state in rows])  # type: ignore[arg-type]

    def drop(self, request_id: str) -> None:
        pass


class Executor(Protocol):
    """Runs scheduled batches. `load()` returns rank 0's pipeline (the model description comes from it)."""

    replicas: list[ReplicaState]

    def load(self) -> Pipeline: ...

    def execute(self, replica: int, call: BatchCall) -> BatchOutcome: ...

    def steps(self) -> StepRunner: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One rank: the batch runs on this process's pipeline, in the calling (engine worker) thread."""

    def __init__(self, load_pipeline: Callable[[], Pipeline], *, clock: Callable[[], float] | None = None):
        self._load_pipeline = load_pipeline
        self._clock = clock
        self.pipeline: Pipeline | None = None
        self.replicas = [ReplicaState(0, (0,))]
        self._lock = threading.Lock()

    def load(self) -> Pipeline:
        self.pipeline = self._load_pipeline()
        return self.pipeline

    def execute(self, replica: int, call: BatchCall) -> BatchOutcome:
        assert self.pipeline is not None, "load() first"
        extra: dict[str, Any] = {"clock": self._clock} if self._clock is not None else {}
        return run_batch(self.pipeline, call.requests, on_step=call.on_step, previews=call.previews or None,
                         max_rows=call.max_rows, on_decoded=call.on_decoded, **extra)

    def steps(self) -> StepRunner:
        assert self.pipeline is not None, "load() first"
        return LocalSteps(self.pipeline)

    def shutdown(self) -> None:
        pass
