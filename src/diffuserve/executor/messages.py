"""The picklable messages between the engine and the ranks that run its batches: batches, pipeline calls, the
events a running batch reports (progress, previews), results.

`BatchMessage` is the one shape of a scheduled batch, whether it runs in this process or on another replica's
leader; `Progress` and `Preview` are what a running batch reports back at its step boundaries. Between ranks they travel through the TCP store of the process group (executor/channel.py), never through a collective, so a
rank waiting for work is not blocked inside a collective (STACK.md's idle trap) and a dead peer shows up as a
missing heartbeat instead of a hang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from diffuserve.errors import DiffuserveError, GenerationError, RequestCancelledError
from diffuserve.pipelines.base import RequestOutput
from diffuserve.sampling import SamplingParams


@dataclass(frozen=True)
class BatchMessage:
    """One scheduled batch for a replica: the engine -> the executor (and rank 0 -> a remote replica's leader)."""

    seq: int = 0
    """Sequence number of the message on its replica (0, 1, 2 ...; set by the executor that posts it)."""
    kind: Literal["batch", "shutdown"] = "batch"
    """batch: run it; shutdown: leave the serving loop."""
    request_ids: tuple[str, ...] = ()
    """The batch's requests, in order."""
    params: tuple[SamplingParams, ...] = ()
    """Each request's sampling parameters (same order as request_ids)."""
    max_rows: int | None = None
    """Row cap of every pipeline call of the batch (dynamic mode), None = one call."""
    compile_warmup: bool = False
    """The engine's warm-up batch: the replica runs it inside its residency's compile_warmup()."""
    previews: tuple[tuple[str, int], ...] = ()
    """(request id, partial images wanted) of the streaming requests: they get `Preview` events."""
    defer_decode: bool = False
    """Decode overlap: the executor may return once the batch is denoised, its decode running in the decode lane
    (`BatchOutcome.decoded`); an executor that cannot defer returns the complete outcome."""

    @property
    def partial_images(self) -> dict[str, int]:
        """`previews` as a dict."""
        return dict(self.previews)


@dataclass(frozen=True)
class Progress:
    """A running batch finished a denoising step (counted over all its pipeline calls)."""

    step: int
    """Index of the step just done (0-based)."""
    num_steps: int
    """Steps of the whole batch."""


@dataclass(frozen=True)
class Preview:
    """A partial image of one streaming request, made after a denoising step."""

    request_id: str
    """The request it belongs to."""
    index: int
    """Which of the request's partial images it is (0-based)."""
    images: list[Any]
    """One PIL image per output row of the request."""


BatchEvent = Progress | Preview
"""What a running batch reports while it runs."""


@dataclass(frozen=True)
class CallMessage:
    """One pipeline call for every rank of a replica: the replica's leader -> its other ranks."""

    seq: int
    """Sequence number of the call on its replica."""
    kind: Literal["call", "shutdown"]
    """call: run `params` as one pipeline call; shutdown: leave the loop."""
    params: tuple[SamplingParams, ...] = ()
    """The call's rows, exactly as the leader runs them."""
    posted_at: float = 0.0
    """time.time() when the leader posted it (the receiver reports how long delivery took)."""
    compile_warmup: bool = False
    """The leader runs it inside its residency's compile_warmup() (--offload-during-compile): so do the others."""
    latents_only: bool = False
    """The leader stops before the decode (it decodes in its decode lane, beside the next batch): the other ranks
    skip the decode, whose output only the leader answers with."""


@dataclass(frozen=True)
class StepMessage:
    """One continuous-batching denoising step for every rank of a replica (the same sequence as CallMessage)."""

    seq: int
    """Sequence number on its replica (shared with pipeline calls)."""
    starts: tuple[tuple[tuple[str, SamplingParams], ...], ...] = ()
    """Groups of requests the leader started together since the last step, each as (request id, params) pairs;
    every rank starts each group the same way (shared encoder calls), so its rows equal the leader's."""
    rows: tuple[str, ...] = ()
    """The step's requests, in the order their rows are stacked."""
    drops: tuple[str, ...] = ()
    """Requests that left (finished, cancelled, failed): their rows are freed (after `starts` is applied)."""
    posted_at: float = 0.0
    """time.time() when the leader posted it."""
    kind: Literal["step"] = "step"


@dataclass(frozen=True)
class ErrorInfo:
    """A request's error, picklable whatever the exception class's constructor takes."""

    kind: Literal["cancelled", "failed"]
    """cancelled (every request of the batch was gone) or failed."""
    message: str
    """The error message shown to the client."""

    @classmethod
    def of(cls, error: DiffuserveError) -> ErrorInfo:
        return cls("cancelled" if isinstance(error, RequestCancelledError) else "failed", error.message)

    def to_error(self) -> DiffuserveError:
        return RequestCancelledError(self.message) if self.kind == "cancelled" else GenerationError(self.message)


@dataclass(frozen=True)
class BatchReport:
    """A replica leader's answer to a `BatchMessage`: per request an output or an error, plus timings."""

    seq: int
    """The BatchMessage it answers."""
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    """Request id -> its images or videos."""
    errors: dict[str, ErrorInfo] = field(default_factory=dict)
    """Request id -> why it has no output."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per pipeline stage (encode, denoise, decode)."""
    inference_seconds: float = 0.0
    """Wall time of the batch on the replica."""
    batch_rows: int = 0
    """Rows of the largest pipeline call."""
    pipeline_calls: int = 0
    """Pipeline calls the batch ran as."""

    @classmethod
    def of(cls, seq: int, outcome) -> BatchReport:  # outcome: executor.worker.BatchOutcome
        return cls(seq=seq, outputs=dict(outcome.outputs),
                   errors={rid: ErrorInfo.of(e) for rid, e in outcome.errors.items()},
                   stage_seconds=dict(outcome.stage_seconds), inference_seconds=outcome.inference_seconds,
                   batch_rows=outcome.batch_rows, pipeline_calls=outcome.pipeline_calls)

    def fields(self) -> dict:
        """The report as BatchOutcome keyword arguments (errors rebuilt as exceptions)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "seq"}
        values["errors"] = {rid: info.to_error() for rid, info in self.errors.items()}
        return values
