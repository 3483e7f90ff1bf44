"""Runs one scheduled batch on the pipeline and turns the result into one outcome per request.

A merged batch is ONE pipeline call, unless its rows exceed the row cap (`max_rows`, the batch's
effective cap in dynamic mode): a request whose `n` alone is above the cap then runs as consecutive
calls of at most `max_rows` rows, part k starting at seed `seed + offset` (row j of a request is
seeded `seed + j`, so its images are the same as in one call). If a call raises, or its outputs
cannot be split back per request, every request of the batch gets an error that says so; there is
no silent retry.

Data in, data out: the batch arrives as a `BatchMessage` (executor/messages.py), it reports `Progress` and
`Preview` events to the caller's `BatchEvents` at its step boundaries and reads back which requests were cancelled
there, and it returns a `BatchOutcome`. Decode overlap (`BatchMessage.defer_decode`, dynamic and continuous modes):
a one-call batch of a native pipeline returns once it is denoised; its decode runs in the pipeline's decode lane
(`pipelines/lanes.py`) while the engine starts the next batch, and the complete outcome is the result of the
returned outcome's `decoded` future.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from diffuserve.errors import DiffuserveError, GenerationError, RequestCancelledError
from diffuserve.executor.messages import BatchEvent, BatchMessage, Preview, Progress
from diffuserve.pipelines.results import BatchResult, RequestOutput
from diffuserve.runtime.cpu_time import PIPELINE_CPU
from diffuserve.sampling import SamplingParams

if TYPE_CHECKING:
    from diffuserve.pipelines.lanes import Lanes, SideResult

logger = logging.getLogger("diffuserve.worker")


class Row(NamedTuple):
    """One request of a batch: its id and parameters (the part of a request that crosses the seam)."""

    request_id: str
    params: SamplingParams


class BatchEvents(Protocol):
    """Where a running batch reports, at its step boundaries, on the thread that runs it: the engine's loop
    records progress, answers deadlines, forwards previews, and says which requests nobody waits for any more."""

    def emit(self, event: BatchEvent) -> None: ...

    def is_cancelled(self, request_id: str) -> bool: ...


class NoEvents:
    """A batch nobody watches (warm-up, a remote leader without a listener): nothing is cancelled."""

    def emit(self, event: BatchEvent) -> None:
        pass

    def is_cancelled(self, request_id: str) -> bool:
        return False


def preview_steps(num_steps: int, partial_images: int) -> list[int]:
    """Step indices after which a request that asked for `partial_images` previews gets one: evenly
    spaced, never the last step (the final image follows it), so short schedules may give fewer."""
    if partial_images <= 0 or num_steps <= 1:
        return []
    steps = {round((j + 1) * num_steps / (partial_images + 1)) - 1 for j in range(partial_images)}
    return sorted(s for s in steps if 0 <= s < num_steps - 1)


@dataclass
class BatchOutcome:
    """What the worker hands back: per request either an output or an error, plus timings."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    errors: dict[str, DiffuserveError] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    inference_seconds: float = 0.0
    batch_rows: int = 0
    """Rows of the largest pipeline call the batch ran as (at most the row cap)."""
    pipeline_calls: int = 0
    """Pipeline calls the batch ran as (1 unless a request's n was split under the row cap)."""
    deferred: bool = False
    """The decode runs in the decode lane: in what `run_batch` returns, the outputs are not there yet (the
    complete outcome, also marked deferred, is the result of `decoded`)."""
    decoded: Future[BatchOutcome] | None = field(default=None, repr=False, compare=False)
    """A deferred outcome's complete outcome, resolved from the decode lane (never fails); None otherwise."""
    decode_overlap_steps: int = 0
    """Denoising steps (of later batches) the loop ran while this batch's decode ran in the decode lane."""
    stopped_at_step: int | None = None
    """The steps it had run when it stopped because every request in it was cancelled (None: it did not stop);
    `diffuserve_stopped_batch_steps` on /metrics, "stopped at step k/N" in the log."""


def split_request(params: SamplingParams, max_rows: int) -> list[SamplingParams]:
    """One request's rows as parts of at most `max_rows` rows; part k starts at seed `seed + offset`."""
    if params.n <= max_rows:
        return [params]
    # An unset seed is drawn once here so that every part continues the same row sequence.
    seed = params.seed if params.seed is not None else random.randrange(2**31)
    return [
        dataclasses.replace(params, n=min(max_rows, params.n - offset), seed=seed + offset)
        for offset in range(0, params.n, max_rows)
    ]


def plan_calls(batch: Sequence[SamplingParams], max_rows: int | None) -> list[list[tuple[int, int, SamplingParams]]]:
    """The pipeline calls for `batch` under a row cap: each call a list of (index in batch, first row,
    params of the part). Consecutive requests share a call while their rows fit; None = one call."""
    if max_rows is None or sum(p.n for p in batch) <= max_rows:
        return [[(i, 0, p) for i, p in enumerate(batch)]]
    calls: list[list[tuple[int, int, SamplingParams]]] = []
    current: list[tuple[int, int, SamplingParams]] = []
    for i, params in enumerate(batch):
        first = 0
        for part in split_request(params, max_rows):
            if current and sum(q.n for _, _, q in current) + part.n > max_rows:
                calls.append(current)
                current = []
            current.append((i, first, part))
            first += part.n
    if current:
        calls.append(current)
    return calls


def _batch_error(requests: Sequence[Row], what: str) -> GenerationError:
    if len(requests) > 1:
        ids = ", ".join(r.request_id for r in requests)
        return GenerationError(f"The dynamic batch of {len(requests)} requests ({ids}) failed: {what}")
    return GenerationError(f"Generation failed: {what}")


def split_outputs(requests: Sequence[Row], result: BatchResult, kind: str) -> dict[str, RequestOutput]:
    """Check the pipeline gave each request exactly its `n` outputs; raise ValueError otherwise."""
    if len(result.outputs) != len(requests):
        raise ValueError(f"the pipeline returned {len(result.outputs)} outputs for {len(requests)} requests")
    split: dict[str, RequestOutput] = {}
    for request, output in zip(requests, result.outputs, strict=True):
        produced = len(output.videos if kind == "video" else output.meshes if kind == "mesh" else output.images)
        if produced != request.params.n:
            raise ValueError(f"request {request.request_id} asked for n={request.params.n} but got {produced}")
        split[request.request_id] = output
    return split


class PipelineCalls(Protocol):
    """What `run_batch` calls: a rank's `ServingPipeline` (pipelines/serving.py), or a replica's leader view of its
    ranks (`executor/replica.ReplicaPipeline`), which runs each call on every rank."""

    lanes: Lanes | None
    """The side lanes when the decode may run apart (`defers_decode`); None: every call decodes in line."""

    @property
    def output_kind(self) -> str: ...

    def run(self, batch: list[SamplingParams], **hooks: Any) -> BatchResult: ...

    def run_to_latents(self, batch: list[SamplingParams], **hooks: Any) -> Any: ...

    def decode_batch(self, denoised: Any) -> BatchResult: ...


def run_batch(
    pipeline: PipelineCalls,
    message: BatchMessage,
    events: BatchEvents | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> BatchOutcome:
    """Run `message`'s requests as one pipeline call (several when their rows exceed `message.max_rows`).

    Never raises: every request gets an output or an error. `Progress` counts steps over all calls.
    `message.defer_decode` turns on decode overlap: when the batch is one call of a pipeline that can stop before
    its decode (`defers_decode`), this returns as soon as denoising is done with `deferred=True` (no outputs yet),
    the decode runs in the pipeline's decode lane (`pipelines/lanes.py`) while the caller starts the next
    batch, and `decoded` resolves to the complete outcome. Otherwise the returned outcome is complete.
    `message.previews` asks for partial images: after each denoising step that some still-waiting request wants
    a preview of, the pipeline's previews are made once for the whole batch and each such request gets a
    `Preview` of its own rows. A batch split into several calls makes no previews (a call holds only part of a
    request's rows, and a preview shows all of them).
    """
    events = events or NoEvents()
    outcome = BatchOutcome()
    live = [
        Row(rid, p) for rid, p in zip(message.request_ids, message.params, strict=True) if not events.is_cancelled(rid)
    ]
    if not live:
        return outcome

    def everyone_gone() -> bool:
        # Stop the whole batch only when nobody in it still wants an answer; a single cancelled row
        # keeps running with the others and its output is dropped.
        return all(events.is_cancelled(r.request_id) for r in live)

    calls = plan_calls([r.params for r in live], message.max_rows)
    if len(calls) > 1:
        logger.info(
            "batch of %d request(s), %d rows: above the row cap of %d, running as %d pipeline calls",
            len(live),
            sum(r.params.n for r in live),
            message.max_rows,
            len(calls),
        )
    lanes = pipeline.lanes
    counter = _StepCounter(len(calls), calls[0][0][2].num_inference_steps, events, lanes)
    on_preview = _preview_hook(live, message.partial_images if len(calls) == 1 else {}, events)

    hooks: dict[str, Any] = {
        "on_step": counter.step_done,
        "should_stop": everyone_gone,
        **({"on_preview": on_preview} if on_preview is not None else {}),
    }
    start = clock()
    if message.defer_decode and lanes is not None and len(calls) == 1:
        return _run_deferred(pipeline, live, outcome, lanes, clock, start, everyone_gone, counter, hooks)
    try:
        _run_calls(pipeline, live, calls, counter, everyone_gone, hooks, outcome)
    except RequestCancelledError as exc:
        logger.info(
            "batch of %d request(s) stopped at step %d/%d: every request in it was cancelled", len(live), *counter.done
        )
        outcome.stopped_at_step = counter.done[0]
        for request in live:
            outcome.errors[request.request_id] = exc
    except Exception as exc:  # the batch loop must survive anything the pipeline raises
        logger.exception("batch of %d request(s) failed", len(live))
        error = _batch_error(live, f"{type(exc).__name__}: {exc}")
        for request in live:
            outcome.errors[request.request_id] = error
    outcome.inference_seconds = clock() - start
    return outcome


def _preview_hook(live: list[Row], wanted: dict[str, int], events: BatchEvents) -> Callable[..., None] | None:
    """The pipeline's `on_preview` for the streaming requests of a batch (`wanted`: request id -> partial images),
    or None when none of them wants previews: after a step some still-waiting request wants a preview of, the
    previews are made once for the whole batch and each such request gets a `Preview` of its own rows."""
    sinks = [(i, wanted[r.request_id]) for i, r in enumerate(live) if r.request_id in wanted]
    if not sinks:
        return None

    def on_preview(step: int, num_steps: int, make_previews: Callable[[], list[list[Any]]]) -> None:
        due = []
        for i, partial_images in sinks:
            steps = preview_steps(num_steps, partial_images)
            if step in steps and not events.is_cancelled(live[i].request_id):
                due.append((i, steps.index(step)))
        if not due:
            return
        per_request = make_previews()
        for i, index in due:
            events.emit(Preview(live[i].request_id, index, per_request[i]))

    return on_preview


class _StepCounter:
    """Counts a batch's steps over all its pipeline calls and reports each as `Progress`."""

    def __init__(self, num_calls: int, num_steps: int, events: BatchEvents, lanes: Lanes | None):
        self.num_calls, self.events, self.lanes = num_calls, events, lanes
        self.call_index = 0
        """The pipeline call running now."""
        self.done = (0, num_calls * num_steps)
        """(steps done, total steps) so far, over all calls."""

    def step_done(self, step: int, num_steps: int) -> None:
        overall, total = self.call_index * num_steps + step, self.num_calls * num_steps
        self.done = (overall + 1, total)
        if self.lanes is not None:
            self.lanes.count_step()  # a decode running in the lane sees the loop advance (`steps_beside`)
        self.events.emit(Progress(overall, total))


def _run_calls(
    pipeline: PipelineCalls,
    live: list[Row],
    calls: list[list[tuple[int, int, SamplingParams]]],
    counter: _StepCounter,
    everyone_gone: Callable[[], bool],
    hooks: dict[str, Any],
    outcome: BatchOutcome,
) -> None:
    """The batch's pipeline calls, one after the other; fills `outcome` (raises what a call raised)."""
    parts: list[list[RequestOutput]] = [[] for _ in live]
    stage_seconds: dict[str, float] = {}
    for counter.call_index, call in enumerate(calls):
        if everyone_gone():
            raise RequestCancelledError("every request of the batch was cancelled")
        with PIPELINE_CPU.measure():
            result = pipeline.run([p for _, _, p in call], **hooks)
        chunk = split_outputs([live[i]._replace(params=p) for i, _, p in call], result, pipeline.output_kind)
        for (i, _, _), output in zip(call, chunk.values(), strict=True):
            parts[i].append(output)
        for stage, seconds in result.stage_seconds.items():
            stage_seconds[stage] = stage_seconds.get(stage, 0.0) + seconds
    outcome.outputs = {r.request_id: _concat(p) for r, p in zip(live, parts, strict=True)}
    outcome.stage_seconds = stage_seconds
    outcome.batch_rows = max(sum(p.n for _, _, p in call) for call in calls)
    outcome.pipeline_calls = len(calls)


def _run_deferred(
    pipeline: PipelineCalls,
    live: list[Row],
    outcome: BatchOutcome,
    lanes: Lanes,
    clock: Callable[[], float],
    start: float,
    should_stop: Callable[[], bool],
    counter: _StepCounter,
    hooks: dict[str, Any],
) -> BatchOutcome:
    """`run_batch` with the decode in the decode lane (one pipeline call; see `run_batch`)."""
    try:
        with PIPELINE_CPU.measure():
            denoised = pipeline.run_to_latents([r.params for r in live], **hooks)
    except RequestCancelledError as exc:
        logger.info(
            "batch of %d request(s) stopped at step %d/%d: every request in it was cancelled", len(live), *counter.done
        )
        outcome.stopped_at_step = counter.done[0]
        outcome.errors = {r.request_id: exc for r in live}
        outcome.inference_seconds = clock() - start
        return outcome
    except Exception as exc:  # the batch loop must survive anything the pipeline raises
        logger.exception("batch of %d request(s) failed", len(live))
        error = _batch_error(live, f"{type(exc).__name__}: {exc}")
        outcome.errors = {r.request_id: error for r in live}
        outcome.inference_seconds = clock() - start
        return outcome

    def decode() -> BatchResult:
        if should_stop():  # nobody waits for these rows any more: skip the decode
            raise RequestCancelledError("every request of the batch was cancelled")
        return pipeline.decode_batch(denoised)

    decoded: Future[BatchOutcome] = Future()

    def deliver(future: Future[SideResult[BatchResult]]) -> None:
        done = BatchOutcome(batch_rows=denoised.latents.shape[0], pipeline_calls=1, deferred=True)
        try:
            side = future.result()
            done.outputs = split_outputs(live, side.value, pipeline.output_kind)
            done.stage_seconds = side.value.stage_seconds
            done.decode_overlap_steps = side.steps_beside
        except RequestCancelledError as exc:
            done.errors = {r.request_id: exc for r in live}
        except Exception as exc:
            logger.exception("decoding a batch of %d request(s) failed", len(live))
            error = _batch_error(live, f"{type(exc).__name__}: {exc}")
            done.errors = {r.request_id: error for r in live}
        done.inference_seconds = clock() - start
        decoded.set_result(done)

    outcome.decoded = decoded
    outcome.deferred = True
    outcome.stage_seconds = dict(denoised.stage_seconds)
    outcome.batch_rows, outcome.pipeline_calls = denoised.latents.shape[0], 1
    outcome.inference_seconds = clock() - start
    lanes.decode.submit(decode, inputs=[denoised], prompts=[r.params.prompt for r in live]).add_done_callback(deliver)
    return outcome


def _concat(outputs: list[RequestOutput]) -> RequestOutput:
    if len(outputs) == 1:
        return outputs[0]
    counts = [o.step_cache for o in outputs if o.step_cache]
    step_cache = (
        None
        if not counts
        else {  # one request's rows over several calls: their steps add up
            "method": counts[0]["method"],
            "computed_steps": sum(c["computed_steps"] for c in counts),
            "reused_steps": sum(c["reused_steps"] for c in counts),
        }
    )
    return RequestOutput(
        images=[i for o in outputs for i in o.images],
        videos=[v for o in outputs for v in o.videos],
        meshes=[m for o in outputs for m in o.meshes],
        step_cache=step_cache,
        audios=[a for o in outputs for a in o.audios],
        audio_sample_rate=next((o.audio_sample_rate for o in outputs if o.audio_sample_rate), None),
    )
