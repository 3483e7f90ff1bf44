"""The request-level loop (`--batching-mode singleton` and `dynamic`): schedule -> execute -> answer.

With data-parallel replicas there is one such loop per replica, sharing the scheduler; a batch is formed only when
a replica is free to run it, and goes to the free replica that has produced the fewest rows (then the lowest
index), so load spreads over replicas instead of going round-robin. Nothing a batch raises stops the loop: its
requests are answered with the error and the scheduler is freed. The step loop (`engine/step_loop.py`) uses
`run_batch` for the heads that cannot run step by step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from diffuserve.config.batching import BatchingMode
from diffuserve.engine.metrics import BatchingStats, EngineMetrics
from diffuserve.engine.request import Request
from diffuserve.engine.request_book import GenerationResult, RequestBook
from diffuserve.engine.scheduler import Dispatch, ScheduledBatch, WaitUntil
from diffuserve.engine.scheduler_protocol import RequestScheduler
from diffuserve.errors import GenerationError, RequestCancelledError, RequestTimeoutError
from diffuserve.executor.base import Executor
from diffuserve.executor.batch_runner import BatchOutcome
from diffuserve.executor.messages import BatchEvent, BatchMessage, Preview, PreviewSink, Progress

logger = logging.getLogger("diffuserve.engine")


class BatchLoop:
    """Runs request-level batches from `scheduler` on `executor`'s replicas, answering through `book`."""

    def __init__(
        self,
        book: RequestBook,
        scheduler: RequestScheduler,
        executor: Executor,
        *,
        metrics: EngineMetrics,
        batching_stats: BatchingStats | None,
        clock: Callable[[], float],
        should_exit: Callable[[], bool],
    ):
        self.book, self.scheduler, self.executor = book, scheduler, executor
        self.metrics, self.batching_stats, self.clock = metrics, batching_stats, clock
        self.should_exit = should_exit
        """Checked under the book's lock: True once the engine stops (or fails); the loop then returns."""
        self.recent_batch_s: float | None = None
        """Wall time of the last batch (the engine's 429 retry hint)."""
        self.defer_decode = BatchingMode(scheduler.config.mode) is not BatchingMode.SINGLETON
        """Overlap (dynamic / continuous): a batch's decode may run in the decode lane while the next batch runs."""

    def run(self) -> None:
        """Serve until the engine stops: one thread per extra replica, replica 0 on the calling thread."""
        for replica in range(1, len(self.executor.replicas)):
            threading.Thread(
                target=self._replica_loop, args=(replica,), name=f"diffuserve-replica-{replica}", daemon=True
            ).start()
        self._replica_loop(0)

    def _replica_loop(self, replica: int) -> None:
        """schedule -> execute -> update, for one replica, until the engine stops."""
        while True:
            batch = self._next_batch(replica)
            if batch is None:
                return
            self.run_batch(batch, replica)

    def run_batch(self, batch: ScheduledBatch, replica: int = 0) -> None:
        """Run one request-level batch; whatever it raises answers its requests and frees the scheduler."""
        try:
            self._execute(batch, replica)
        except Exception as exc:  # the batch loop never dies: answer the batch, free the scheduler
            logger.exception("internal error around a batch")
            error = GenerationError(f"Internal error while running this batch: {type(exc).__name__}: {exc}")
            with self.book.cond:
                for request in batch.requests:
                    self.book.answer_locked(request.request_id, error=error)
                if self.scheduler.is_running(batch):
                    self.scheduler.complete(batch)
                self._replica_done(replica, 0)
                self.book.cond.notify_all()

    # -- scheduling ---------------------------------------------------------------------------------------
    def _my_turn(self, replica: int) -> bool:
        """Whether `replica` is the free replica that should take the next batch: the one that has produced the
        fewest rows (then the lowest index)."""
        free = [s for s in self.executor.replicas if not s.busy and s.failed is None]
        return bool(free) and min(free, key=lambda s: (s.rows, s.replica)).replica == replica

    def _replica_done(self, replica: int, rows: int) -> None:
        """Caller holds the lock."""
        state = self.executor.replicas[replica]
        state.busy = False
        state.batches += 1
        state.rows += rows
        self.metrics.set_running(sum(len(b.requests) for b in self.scheduler.running_batches))

    def _next_batch(self, replica: int) -> ScheduledBatch | None:
        book, scheduler = self.book, self.scheduler
        with book.cond:
            while True:
                if self.should_exit():
                    return None
                now = self.clock()
                if not self._my_turn(replica):
                    book.idle_wait(now)
                    continue
                for request in scheduler.expire(now):
                    book.answer_locked(
                        request.request_id,
                        error=RequestTimeoutError("The request waited in the queue past its deadline and was not run."),
                    )
                action = scheduler.schedule(now)
                if isinstance(action, Dispatch):
                    self.executor.replicas[replica].busy = True
                    book.cond.notify_all()  # the next free replica may schedule now
                    return action.batch
                book.idle_wait(now, scheduler.next_deadline(), action.time if isinstance(action, WaitUntil) else None)

    # -- one batch ----------------------------------------------------------------------------------------
    def _execute(self, batch: ScheduledBatch, replica: int) -> None:
        requests: list[Request] = list(batch.requests)
        if self.batching_stats is not None:
            self.batching_stats.record(batch)
        started = self.clock()
        for request in requests:
            self.metrics.observe_queue_wait(started - request.arrival_time)
        with self.book.cond:
            self.metrics.set_running(sum(len(b.requests) for b in self.scheduler.running_batches))
            previews = self.book.mark_started(requests, started)

        message = BatchMessage(
            request_ids=tuple(r.request_id for r in requests),
            params=tuple(r.params for r in requests),
            # The row cap is a hard cap on every pipeline call in dynamic mode (operators size it to the
            # device): an oversized request the scheduler dispatched alone runs as several calls.
            max_rows=batch.effective_cap if self.scheduler.config.dynamic else None,
            previews=tuple((rid, sink.partial_images) for rid, sink in previews.items()),
            # Overlap (dynamic / continuous): the batch's decode may run in the decode lane while this thread
            # frees the scheduler and starts the next batch (executor/batch_runner.py `run_batch`).
            defer_decode=self.defer_decode,
        )
        outcome = self.executor.execute(replica, message, _BatchListener(self, requests, previews))
        self.recent_batch_s = outcome.inference_seconds
        if outcome.decoded is not None:  # answered once the decode lane has the outputs
            with self.book.cond:  # the scheduler waits for these answers (scheduler rule 8)
                self.scheduler.note_answering(batch)
            outcome.decoded.add_done_callback(lambda done: self._answer(batch, done.result(), started))
        else:
            self._answer(batch, outcome, started)
        with self.book.cond:
            self.scheduler.complete(batch)
            produced = (
                outcome.batch_rows
                if outcome.deferred
                else sum(r.params.n for r in requests if r.request_id in outcome.outputs)
            )
            self._replica_done(replica, produced)
            self.book.cond.notify_all()

    def _step_boundary(self, requests: list[Request], step: int, num_steps: int) -> None:
        """Progress, and deadlines: requests past theirs are answered 504 now; the batch goes on for the others
        (and stops when nobody in it still waits)."""
        now = self.clock()
        with self.book.cond:
            for request in requests:
                self.book.set_progress(request.request_id, step + 1, num_steps)
                if request.deadline is not None and now > request.deadline and not request.cancel_event.is_set():
                    request.cancel_event.set()
                    self.book.answer_locked(
                        request.request_id,
                        error=RequestTimeoutError(
                            f"The request ran past its deadline and was cancelled at step {step + 1}/{num_steps}."
                        ),
                    )

    def _answer(self, batch: ScheduledBatch, outcome: BatchOutcome, started: float) -> None:
        try:
            self._answer_all(list(batch.requests), outcome, started)
        finally:
            with self.book.cond:
                self.scheduler.note_answered(batch, self.clock())
                self.book.cond.notify_all()

    def _answer_all(self, requests: list[Request], outcome: BatchOutcome, started: float) -> None:
        for stage, seconds in outcome.stage_seconds.items():
            self.metrics.observe_stage(stage, seconds)
        if outcome.deferred:
            self.metrics.observe_overlap("decode", outcome.decode_overlap_steps)
        if outcome.stopped_at_step is not None:
            self.metrics.stopped_batch_steps.observe(outcome.stopped_at_step)
        with self.book.cond:
            for request in requests:
                rid = request.request_id
                if rid in outcome.outputs:
                    self.metrics.add_outputs_generated(request.params.n)
                    self.book.answer_locked(
                        rid,
                        result=GenerationResult(
                            request_id=rid,
                            output=outcome.outputs[rid],
                            queue_wait_s=started - request.arrival_time,
                            inference_s=outcome.inference_seconds,
                            batch_size=len(requests),
                            stage_seconds=outcome.stage_seconds,
                            batch_rows=outcome.batch_rows,
                            pipeline_calls=outcome.pipeline_calls,
                            batch_tokens=_call_tokens(requests, outcome.batch_rows, outcome.pipeline_calls),
                        ),
                    )
                else:
                    self.book.answer_locked(rid, error=outcome.errors.get(rid) or RequestCancelledError("cancelled"))
            self.book.cond.notify_all()


def _call_tokens(requests: list[Request], rows: int, calls: int) -> int:
    """Latent tokens of the (largest) call of a batch: all of its requests' in one call; a request split into calls
    of `rows` rows (over the row cap or the token budget) has `rows` rows of its size in the largest."""
    if calls <= 1:
        return sum(r.tokens for r in requests)
    return rows * max(r.tokens_per_row for r in requests)


class _BatchListener:
    """The `BatchEvents` of one batch: progress and deadlines at each step boundary, previews to their sinks, and
    the requests' cancel flags (client gone, deadline, shutdown) read back by the running batch."""

    def __init__(self, loop: BatchLoop, requests: list[Request], previews: dict[str, PreviewSink]):
        self.loop, self.requests, self.previews = loop, requests, previews
        self._by_id = {r.request_id: r for r in requests}

    def emit(self, event: BatchEvent) -> None:
        if isinstance(event, Progress):
            self.loop._step_boundary(self.requests, event.step, event.num_steps)
        elif isinstance(event, Preview):
            sink = self.previews.get(event.request_id)
            if sink is not None:
                sink.deliver(event.index, event.images)

    def is_cancelled(self, request_id: str) -> bool:
        request = self._by_id.get(request_id)
        return request is None or request.cancel_event.is_set()
