"""The engine's side of the seam: `Executor` (request-level batches in, outcomes out), `StepRunner` (continuous
batching's moves), and their one-rank implementations `InProcessExecutor` and `PipelineSteps`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from diffuserve.executor.batch_runner import BatchEvents, BatchOutcome, run_batch
from diffuserve.executor.messages import BatchMessage
from diffuserve.pipelines.base import Pipeline
from diffuserve.pipelines.capabilities import Capabilities
from diffuserve.pipelines.results import RequestOutput
from diffuserve.pipelines.serving import ServingPipeline
from diffuserve.sampling import SamplingParams

__all__ = [
    "Capabilities",
    "Executor",
    "InProcessExecutor",
    "Pipeline",
    "PipelineSteps",
    "ReplicaState",
    "RequestOutput",
    "ServingPipeline",
    "StepRunner",
]
"""`Pipeline`, `ServingPipeline`, `Capabilities` and `RequestOutput` are re-exported so the engine imports nothing
from `pipelines/`. The seam is not yet the whole contact: with continuous batching the engine's step loop
(`engine/step_loop.py`) drives the StepRunner's `lanes` itself, submitting starts, previews and decodes to the encode
and decode lanes, and making the loop's CUDA stream wait for the encode lane's (`SideResult.take`)."""


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


class StepRunner(Protocol):
    """Continuous batching's moves, on every rank of replica 0 (start, step, drop) or on its leader (snapshot,
    preview, finish): start the requests joining at one boundary (shared encoder calls; each gets its
    `pipelines.step_batch.RequestRows`, or the exception that failed it alone), step the group, drop a request
    that left, copy a request's state for a preview, make its preview, decode the requests that finished.
    `lanes` are the pipeline's side lanes (`pipelines/lanes.py`: start in the encode lane, previews and finishes
    in the decode lane, beside the loop), None when they run inline; `device` is where the rows live."""

    lanes: Any
    device: Any

    def start(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[Any]: ...

    def step(self, rows: Sequence[tuple[str, Any]]) -> None: ...

    def drop(self, request_id: str) -> None: ...

    def snapshot(self, state: Any) -> Any: ...

    def preview(self, state: Any) -> list[Any]: ...

    def finish(self, states: Sequence[Any]) -> list[RequestOutput]: ...


class PipelineSteps:
    """StepRunner over this process's pipeline: the `pipelines/step_batch.py` pieces. Start, step and drop go to
    `ranks` when the replica has several ranks (`executor/replica.py`: every rank runs them); snapshot, preview and
    finish run here only (the leader answers)."""

    def __init__(self, pipeline: ServingPipeline, ranks: Any = None):
        self.pipeline = pipeline
        self.ranks = ranks
        """The replica's StepRunner for start / step / drop on every rank; None = this rank alone."""
        self.lanes = pipeline.lanes
        self.device = pipeline.device
        self._conds: Any = None
        """The group's stacked conditioning across steps (`step_batch.GroupConds`, made on the first step)."""

    def start(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[Any]:
        if self.ranks is not None:
            return self.ranks.start(requests)
        from diffuserve.pipelines import step_batch

        return step_batch.start_group(self.pipeline.served, [params for _, params in requests])  # type: ignore[arg-type]

    def step(self, rows: Sequence[tuple[str, Any]]) -> None:
        self.pipeline.check_step([state.params for _, state in rows])  # operator-only fault injection
        if self.ranks is not None:
            self.ranks.step(rows)
            return
        from diffuserve.pipelines import step_batch

        if self._conds is None:
            self._conds = step_batch.GroupConds()
        step_batch.denoise_step(self.pipeline.served, [state for _, state in rows], self._conds)  # type: ignore[arg-type]

    def drop(self, request_id: str) -> None:
        if self.ranks is not None:
            self.ranks.drop(request_id)

    def snapshot(self, state: Any) -> Any:
        from diffuserve.pipelines import step_batch

        return step_batch.snapshot(state)

    def preview(self, state: Any) -> list[Any]:
        from diffuserve.pipelines import step_batch

        return step_batch.preview_request(self.pipeline.served, state)  # type: ignore[arg-type]

    def finish(self, states: Sequence[Any]) -> list[RequestOutput]:
        from diffuserve.pipelines import step_batch

        return step_batch.finish_requests(self.pipeline.served, states)  # type: ignore[arg-type]


class Executor(Protocol):
    """Runs scheduled batches. `load()` returns rank 0's serving pipeline (the model description comes from it).

    `execute` takes the batch as data (`BatchMessage`) and returns data (`BatchOutcome`); while it runs, the batch
    reports `Progress` / `Preview` events to `events` and reads back which requests were cancelled."""

    replicas: list[ReplicaState]
    multi_rank: bool
    """Batches run on other processes' ranks too (the server leaves with `os._exit` after its drain: a worker thread
    may still sit in a collective with a failed peer)."""

    def load(self) -> ServingPipeline: ...

    def execute(self, replica: int, message: BatchMessage, events: BatchEvents) -> BatchOutcome: ...

    def steps(self) -> StepRunner: ...

    def prefetch(self, params: SamplingParams, on_done: Callable[[int], None]) -> bool: ...

    def shutdown(self) -> None: ...

    def describe(self) -> dict[str, Any] | None:
        """/server_info's `distributed` section: the ranks and their topology; None for one process."""


class InProcessExecutor:
    """One rank: the batch runs on this process's pipeline, in the calling (engine worker) thread."""

    multi_rank = False

    def __init__(self, load_pipeline: Callable[[], ServingPipeline], *, clock: Callable[[], float] | None = None):
        self._load_pipeline = load_pipeline
        self._clock = clock
        self.pipeline: ServingPipeline | None = None
        self.replicas = [ReplicaState(0, (0,))]

    def load(self) -> ServingPipeline:
        self.pipeline = self._load_pipeline()
        return self.pipeline

    def execute(self, replica: int, message: BatchMessage, events: BatchEvents) -> BatchOutcome:
        assert self.pipeline is not None, "load() first"
        extra: dict[str, Any] = {"clock": self._clock} if self._clock is not None else {}
        return run_batch(self.pipeline, message, events, **extra)

    def steps(self) -> StepRunner:
        assert self.pipeline is not None, "load() first"
        return PipelineSteps(self.pipeline)

    def prefetch(self, params: SamplingParams, on_done: Callable[[int], None]) -> bool:
        """Dynamic batching: encode a queued request's texts in the encode lane beside the running batch
        (`pipelines/text_prefetch.py`). False when the pipeline cannot (or there was nothing to do)."""
        assert self.pipeline is not None, "load() first"
        return self.pipeline.prefetch_text(params, on_done)

    def shutdown(self) -> None:
        pass

    def describe(self) -> dict[str, Any] | None:
        return None
