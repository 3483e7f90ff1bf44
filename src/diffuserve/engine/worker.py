"""Runs one scheduled batch on the pipeline and turns the result into one outcome per request.

A merged batch is ONE pipeline call. If it raises, or its outputs cannot be split back per request,
every request of the batch gets an error that says so; there is no silent retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffuserve.engine.request import Request
from diffuserve.errors import DiffuserveError, GenerationError, RequestCancelledError
from diffuserve.pipelines.base import BatchResult, Pipeline, RequestOutput

logger = logging.getLogger("diffuserve.worker")


def preview_steps(num_steps: int, partial_images: int) -> list[int]:
    """Step indices after which a request that asked for `partial_images` previews gets one: evenly
    spaced, never the last step (the final image follows it), so short schedules may give fewer."""
    if partial_images <= 0 or num_steps <= 1:
        return []
    steps = {round((j + 1) * num_steps / (partial_images + 1)) - 1 for j in range(partial_images)}
    return sorted(s for s in steps if 0 <= s < num_steps - 1)


@dataclass
class PreviewSink:
    """Where one request's partial images go while its batch denoises (streaming requests)."""

    partial_images: int
    """How many previews the request asked for (0-3)."""
    deliver: Callable[[int, list[Any]], None]
    """deliver(partial_image_index, images): one PIL image per output row of the request. Called from the
    worker thread, so it must only hand the images over (e.g. `loop.call_soon_threadsafe`)."""


@dataclass
class BatchOutcome:
    """What the worker hands back: per request either an output or an error, plus timings."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    errors: dict[str, DiffuserveError] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    inference_seconds: float = 0.0


def _batch_error(requests: Sequence[Request], what: str) -> GenerationError:
    if len(requests) > 1:
        ids = ", ".join(r.request_id for r in requests)
        return GenerationError(f"The dynamic batch of {len(requests)} requests ({ids}) failed: {what}")
    return GenerationError(f"Generation failed: {what}")


def split_outputs(requests: Sequence[Request], result: BatchResult, kind: str) -> dict[str, RequestOutput]:
    """Check the pipeline gave each request exactly its `n` outputs; raise ValueError otherwise."""
    if len(result.outputs) != len(requests):
        raise ValueError(f"the pipeline returned {len(result.outputs)} outputs for {len(requests)} requests")
    split: dict[str, RequestOutput] = {}
    for request, output in zip(requests, result.outputs, strict=True):
        produced = len(output.videos if kind == "video" else output.images)
        if produced != request.params.n:
            raise ValueError(f"request {request.request_id} asked for n={request.params.n} but got {produced}")
        split[request.request_id] = output
    return split


def run_batch(
    pipeline: Pipeline,
    requests: Sequence[Request],
    *,
    on_step: Callable[[int, int], None] | None = None,
    previews: dict[str, PreviewSink] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> BatchOutcome:
    """Run `requests` as one pipeline call. Never raises: every request gets an output or an error.

    `previews` (request id -> sink) asks for partial images: after each denoising step that some
    still-waiting request wants a preview of, the pipeline's previews are made once for the whole batch
    and each such request gets its own rows.
    """
    outcome = BatchOutcome()
    live = [r for r in requests if not r.cancel_event.is_set()]
    if not live:
        return outcome

    def should_stop() -> bool:
        # Stop the whole batch only when nobody in it still wants an answer; a single cancelled row
        # keeps running with the others and its output is dropped.
        return all(r.cancel_event.is_set() for r in live)

    steps_done = [0, 0]

    def step_done(step: int, num_steps: int) -> None:
        steps_done[:] = [step + 1, num_steps]
        if on_step is not None:
            on_step(step, num_steps)

    sinks = [(i, previews[r.request_id]) for i, r in enumerate(live) if previews and r.request_id in previews]

    def on_preview(step: int, num_steps: int, make_previews: Callable[[], list[list[Any]]]) -> None:
        wanted = []
        for i, sink in sinks:
            steps = preview_steps(num_steps, sink.partial_images)
            if step in steps and not live[i].cancel_event.is_set():
                wanted.append((i, sink, steps.index(step)))
        if not wanted:
            return
        per_request = make_previews()
        for i, sink, index in wanted:
            sink.deliver(index, per_request[i])

    start = clock()
    try:
        result = pipeline.run([r.params for r in live], on_step=step_done, should_stop=should_stop,
                              **({"on_preview": on_preview} if sinks else {}))
        outcome.outputs = split_outputs(live, result, pipeline.output_kind)
        outcome.stage_seconds = dict(result.stage_seconds)
    except RequestCancelledError as exc:
        logger.info("batch of %d request(s) stopped at step %d/%d: every request in it was cancelled",
                    len(live), *steps_done)
        for request in live:
            outcome.errors[request.request_id] = exc
    except Exception as exc:  # the batch loop must survive anything the pipeline raises
        logger.exception("batch of %d request(s) failed", len(live))
        error = _batch_error(live, f"{type(exc).__name__}: {exc}")
        for request in live:
            outcome.errors[request.request_id] = error
    outcome.inference_seconds = clock() - start
    return outcome
