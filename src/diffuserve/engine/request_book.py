"""The request book: every accepted request's future, answered exactly once, and the lock the engine runs under.

The event loop admits requests into the book (`AsyncEngine`); the serving loops (`engine/batch_loop.py`,
`engine/step_loop.py`) record their progress in it and answer them through it, from the engine's threads and the
decode lane. Whoever answers first wins: a success, an error, a timeout, a cancel, a shutdown or a rank fault, and
every later answer of the same request is a no-op. The book's condition (`cond`) is the one lock of the engine: the
scheduler is only touched under it, and the loops wait on it (`idle_wait`) for new requests or their next deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from diffuserve.engine.metrics import EngineMetrics
from diffuserve.engine.request import Request, RequestStatus
from diffuserve.errors import DiffuserveError, RequestCancelledError, RequestTimeoutError
from diffuserve.executor.base import RequestOutput
from diffuserve.executor.messages import PreviewSink

MAX_IDLE_WAIT_S = 0.5
"""Upper bound on a loop's sleep, so queued deadlines are checked even when nothing else happens."""


@dataclass
class GenerationResult:
    """The answer to one request."""

    request_id: str
    """The request it answers."""
    output: RequestOutput
    """Its images or videos."""
    queue_wait_s: float
    """Seconds from admission to the start of its batch (or of its start in continuous mode)."""
    inference_s: float
    """Seconds its batch ran (continuous: from its start to its answer)."""
    batch_size: int
    """Requests in the pipeline batch this request ran in (kept for compatibility: = batch_requests)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per stage (encode, denoise, decode) of its batch."""
    batch_rows: int = 0
    """Rows of the (largest) pipeline call this request ran in; at most the row cap."""
    pipeline_calls: int = 1
    """Pipeline calls its batch ran as (> 1 when a request's n was above --batching-max-size)."""
    batch_tokens: int = 0
    """Latent tokens of that call (its rows x each row's tokens; `--batching-max-tokens` counts them)."""

    @property
    def batch_requests(self) -> int:
        """Requests in the batch this request ran in."""
        return self.batch_size


@dataclass(eq=False)
class PendingRequest:
    """An accepted request that has not been answered yet, and where its answer goes."""

    request: Request
    """The request (the scheduler holds the same object)."""
    future: asyncio.Future[GenerationResult]
    """Resolved once, on `loop`, with the result or the error."""
    loop: asyncio.AbstractEventLoop
    """The event loop the future belongs to (answers are handed over with `call_soon_threadsafe`)."""
    endpoint: str
    """The API it came through (the label of the request metrics)."""
    answered: bool = False
    """Set by the first answer; later answers do nothing."""
    dispatched_at: float | None = None
    """Clock time its batch (or its start) began; None while queued."""
    num_steps: int | None = None
    """Denoising steps of the batch it runs in; None while queued."""
    steps_done: int = 0
    """Denoising steps finished so far (updated at every step boundary)."""
    preview: PreviewSink | None = None
    """Where the request's partial images go (streaming requests); None = no previews."""


def status_of(error: DiffuserveError | None) -> tuple[RequestStatus, str]:
    """The request's final status and its metrics label, for an answer with `error` (None = success)."""
    if error is None:
        return RequestStatus.FINISHED, "success"
    status = {RequestTimeoutError: RequestStatus.TIMED_OUT, RequestCancelledError: RequestStatus.ABORTED}.get(
        type(error), RequestStatus.FAILED
    )
    return status, {RequestStatus.TIMED_OUT: "timeout", RequestStatus.ABORTED: "cancelled"}.get(status, "error")


class RequestBook:
    """Pending requests by id, the engine's lock, and the answer-once rule."""

    def __init__(self, metrics: EngineMetrics, clock: Callable[[], float]):
        self.metrics = metrics
        self.clock = clock
        self.cond = threading.Condition()
        """The engine's one lock (the book and the scheduler are read and written under it) and its wake-ups."""
        self._pending: dict[str, PendingRequest] = {}

    # -- reading ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self.cond:
            return len(self._pending)

    def get(self, request_id: str) -> PendingRequest | None:
        """The pending request, None once answered (or unknown). Caller holds the lock."""
        return self._pending.get(request_id)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request; None while queued, or once answered/unknown."""
        with self.cond:
            pending = self._pending.get(request_id)
            if pending is None or pending.num_steps is None:
                return None
            return pending.steps_done, pending.num_steps

    def adapters_in_use(self) -> tuple[str, ...]:
        """The LoRA adapters the requests not answered yet name, sorted (`EngineStatus.adapters_in_use`)."""
        with self.cond:
            return tuple(sorted({name for p in self._pending.values() for name, _ in p.request.params.lora}))

    # -- writing (caller holds the lock) -----------------------------------------------------------------------
    def admit(self, pending: PendingRequest) -> None:
        """Record an accepted request (the caller queues it in the scheduler under the same lock)."""
        self._pending[pending.request.request_id] = pending

    def mark_started(self, requests: list[Request], now: float) -> dict[str, PreviewSink]:
        """The requests' batch (or start) began at `now`; returns the preview sinks of the streaming ones."""
        previews: dict[str, PreviewSink] = {}
        for request in requests:
            pending = self._pending.get(request.request_id)
            if pending is not None:
                pending.dispatched_at = now
                pending.num_steps = request.params.num_inference_steps
                if pending.preview is not None:
                    previews[request.request_id] = pending.preview
        return previews

    def set_progress(self, request_id: str, steps_done: int, num_steps: int) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.steps_done, pending.num_steps = steps_done, num_steps

    def answer_locked(
        self, request_id: str, *, result: GenerationResult | None = None, error: DiffuserveError | None = None
    ) -> None:
        """Answer exactly once (caller holds the lock): the first answer wins, later ones do nothing."""
        pending = self._pending.pop(request_id, None)
        if pending is None or pending.answered:
            return
        pending.answered = True
        request = pending.request
        request.status, label = status_of(error)
        if request.ineligible_reason != "warmup":
            self.metrics.observe_request(pending.endpoint, label, self.clock() - request.arrival_time)
            if result is not None:
                self.metrics.observe_step_cache(result.output.step_cache)

        def deliver() -> None:
            if pending.future.done():
                return
            if error is None:
                pending.future.set_result(result)  # type: ignore[arg-type]
            else:
                pending.future.set_exception(error)

        try:
            pending.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def answer(
        self, request_id: str, *, result: GenerationResult | None = None, error: DiffuserveError | None = None
    ) -> None:
        """`answer_locked`, taking the lock."""
        with self.cond:
            self.answer_locked(request_id, result=result, error=error)
            self.cond.notify_all()

    def cancel(self, request_id: str, error: DiffuserveError) -> bool:
        """Set the request's cancel flag (a running batch stops it at its next step) and answer it with `error`;
        False when it was already answered. Caller holds the lock."""
        pending = self._pending.get(request_id)
        if pending is None or pending.answered:
            return False
        pending.request.cancel_event.set()
        self.answer_locked(request_id, error=error)
        return True

    def fail_all(self, error: DiffuserveError) -> int:
        """Cancel and answer every request not answered yet with `error`. Caller holds the lock (and has drained
        the scheduler's queue first, so no queued request starts). Returns how many were answered."""
        unanswered = [p.request.request_id for p in self._pending.values() if not p.answered]
        for request_id in unanswered:
            self.cancel(request_id, error)
        return len(unanswered)

    # -- waiting ---------------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Wake every loop waiting on the book (a start finished, a request arrived)."""
        with self.cond:
            self.cond.notify_all()

    def idle_wait(self, now: float, *wake_at: float | None) -> None:
        """Sleep (caller holds the lock) until the earliest of `wake_at` (clock times), a notify, or at most
        `MAX_IDLE_WAIT_S`, so queued deadlines are checked even when nothing else happens."""
        self.cond.wait(min([MAX_IDLE_WAIT_S, *(max(0.0, t - now) for t in wake_at if t is not None)]))
