"""The engine loop of `--batching-mode continuous`: the step scheduler (`engine/step_scheduler.py`) driving the
executor's `StepRunner` (executor/base.py: the resumable recipe of `pipelines/step_batch.py`, on every rank of the
replica) on the engine's worker thread.

Each turn: schedule under the engine lock -> hand the requests that joined to the encode lane (one shared encode +
their latents, in the StepRunner's `lanes`) -> collect the starts that finished: those requests step from this
boundary on -> ONE denoising step for the ready rows -> previews and the decode of every request whose last step
it was go to the decode lane, which answers them, while the loop goes on to the next turn. Without lanes (a
pipeline that cannot overlap) the same happens inline. Heads that cannot run step by step (image-conditioned
requests, a family that is not continuous) run as request-level batches through `fallback` (the engine passes
`BatchLoop.run_batch`, `engine/batch_loop.py`).

Failures: a request whose start (encode / prepare) raises fails alone; a step that raises fails every request in
that step (they shared the one denoiser call, so none of their latents can be trusted) and the loop keeps serving.
Cancellation, deadline and disconnect remove a row at the next step boundary (`StepScheduler.schedule`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from diffuserve.engine.metrics import ContinuousStats, EngineMetrics
from diffuserve.engine.request_book import GenerationResult, RequestBook
from diffuserve.engine.scheduler import Dispatch, ScheduledBatch, WaitUntil, batch_facts
from diffuserve.engine.step_scheduler import REMOVED_DEADLINE, GroupEntry, StepPlan, StepScheduler
from diffuserve.errors import GenerationError, RequestTimeoutError
from diffuserve.executor.base import Executor
from diffuserve.executor.batch_runner import preview_steps

logger = logging.getLogger("diffuserve.engine")


class StepLoop:
    """Serves a `StepScheduler`'s group step by step on `executor`'s replica 0, answering through `book`, until
    the engine stops; heads that cannot step go to `fallback` as request-level batches."""

    def __init__(
        self,
        book: RequestBook,
        scheduler: StepScheduler,
        executor: Executor,
        *,
        fallback: Callable[[ScheduledBatch], None],
        metrics: EngineMetrics,
        log_steps: bool,
        clock: Callable[[], float],
        should_exit: Callable[[], bool],
    ):
        self.book, self.scheduler, self.fallback = book, scheduler, fallback
        self.metrics, self.clock, self.should_exit = metrics, clock, should_exit
        self.stats = ContinuousStats(metrics, log_enabled=log_steps)
        self._timing: dict[str, dict[str, float]] = {}
        """request id -> its stage seconds (encode / denoise / decode) so far."""
        self.steps = executor.steps()
        """Start / step / drop on every rank of the replica; snapshot / preview / finish on its leader."""
        self.lanes = self.steps.lanes
        """The side lanes (encode, decode) of a native pipeline; None = start and decode inline."""
        self.encode_lane: Any = self.lanes.encode if self.lanes is not None else InlineLane()
        self.decode_lane: Any = self.lanes.decode if self.lanes is not None else InlineLane()
        self._starting: list[tuple[list[GroupEntry], Future[Any]]] = []
        """Entries that joined at one boundary and their start (encode + latents), running or not collected yet."""
        self._left = 0
        """Requests that left since the last step line."""

    def run(self) -> None:
        while True:
            decision = self._next()
            if decision is None:
                return
            if isinstance(decision, Dispatch):
                self.fallback(decision.batch)
                continue
            try:
                self._turn(decision)
            except Exception as exc:  # the loop never dies: fail what is still in the group, keep serving
                logger.exception("internal error around a continuous denoising step")
                self._fail(self.scheduler.group, f"internal error: {type(exc).__name__}: {exc}")

    # -- scheduling ---------------------------------------------------------------------------------------
    def _next(self) -> Dispatch | StepPlan | None:
        book, scheduler = self.book, self.scheduler
        with book.cond:
            while True:
                if self.should_exit():
                    return None
                now = self.clock()
                for request in scheduler.expire(now):
                    book.answer_locked(
                        request.request_id,
                        error=RequestTimeoutError("The request waited in the queue past its deadline and was not run."),
                    )
                decision = scheduler.schedule(now)
                if isinstance(decision, StepPlan):
                    for request, reason in decision.removed:
                        self._timing.pop(request.request_id, None)
                        self.steps.drop(request.request_id)
                        self.stats.record_leave(reason)
                        if reason == REMOVED_DEADLINE:
                            book.answer_locked(
                                request.request_id,
                                error=RequestTimeoutError(
                                    "The request ran past its deadline and was removed from the denoise group."
                                ),
                            )
                        # cancelled rows were answered when they were cancelled (abort / fail_all)
                    return decision
                if isinstance(decision, Dispatch):
                    return decision
                self.stats.set_idle()
                self.metrics.set_running(0)
                book.idle_wait(
                    now, scheduler.next_deadline(), decision.time if isinstance(decision, WaitUntil) else None
                )

    # -- one turn -----------------------------------------------------------------------------------------
    def _turn(self, plan: StepPlan) -> None:
        if plan.joined:
            self._start(plan.joined)
        self._left += plan.left
        joined = self._collect_started()
        group = self.scheduler.group
        rows = [e for e in group if e.ready and e.state is not None]
        if not rows:
            self._wait_for_starts()
            return
        num_rows = sum(e.num_rows for e in rows)
        facts = batch_facts([e.request for e in rows])
        tokens = (facts["num_tokens"], facts["num_sizes"], facts["padding_tokens"], self.scheduler.token_budget)
        self.stats.record_step(num_rows, plan.cap, joined, self._left, len(rows), tokens)
        self._left = 0
        self.metrics.set_running(len(rows))
        started = time.perf_counter()
        try:
            self.steps.step([(e.request.request_id, e.state) for e in rows])
        except Exception as exc:
            logger.exception("continuous denoising step of %d request(s) failed", len(rows))
            self._fail(rows, f"{type(exc).__name__}: {exc}")
            return
        if self.lanes is not None:
            self.lanes.count_step()
        seconds = time.perf_counter() - started
        for entry in rows:
            timing = self._timing.setdefault(entry.request.request_id, {})
            timing["denoise"] = timing.get("denoise", 0.0) + seconds
        with self.book.cond:
            finished = self.scheduler.step_done(plan, rows)
            for entry in rows:
                self.book.set_progress(entry.request.request_id, entry.step_index, entry.num_steps)
        self._previews(rows, finished)
        if finished:
            # batch_rows: the rows of the step that finished them (was always 0 in continuous mode).
            call = (sum(e.num_rows for e in rows), sum(e.request.tokens for e in rows))
            self._finish(finished, batch_size=len(rows), call=call)

    # -- starting (encode + latents), beside the loop when it can -----------------------------------------
    def _start(self, entries: list[GroupEntry]) -> None:
        """Start the requests that joined at this boundary: one encode-lane job for all of them."""
        now = self.clock()
        with self.book.cond:
            for entry in entries:
                self.metrics.observe_queue_wait(now - entry.request.arrival_time)
                entry.ready = False
            self.book.mark_started([e.request for e in entries], now)
        batch = [e.request.params for e in entries]
        ids = [e.request.request_id for e in entries]

        def start() -> list[Any]:  # shared encoder calls; a request whose start raises fails alone
            return self.steps.start(list(zip(ids, batch, strict=True)))

        future = self.encode_lane.submit(start, prompts=[p.prompt for p in batch])
        if self.lanes is not None:
            future.add_done_callback(lambda _: self.book.wake())
        self._starting.append((entries, future))

    def _collect_started(self) -> int:
        """Entries whose start finished become ready (they step from this boundary on); returns how many."""
        joined = 0
        for item in [item for item in self._starting if item[1].done()]:
            self._starting.remove(item)
            entries, future = item
            try:
                side = future.result()
                # CUDA: the loop's stream waits for the encode lane's before using the rows it made.
                results = side.take(self.steps.device)
            except Exception as exc:
                results = [exc] * len(entries)
                side = None
            group = self.scheduler.group
            for entry, result in zip(entries, results, strict=True):
                request = entry.request
                if entry not in group:
                    continue  # removed while it was starting (cancelled, deadline): already answered
                if isinstance(result, Exception):
                    logger.error("starting request %s failed", request.request_id, exc_info=result)
                    self._fail([entry], f"{type(result).__name__}: {result}")
                    continue
                assert side is not None
                entry.state = result
                # The pipeline's own schedule is what counts (it may be shorter than requested, e.g. img2img strength).
                entry.num_steps = entry.state.num_steps
                entry.ready = True
                joined += 1
                self._timing[request.request_id] = {"encode": side.seconds}
            if side is not None and self.lanes is not None:
                self.metrics.observe_overlap("encode", side.steps_beside)
        return joined

    def _wait_for_starts(self) -> None:
        """Nothing is ready to step: sleep until a start finishes (or a request arrives, or the stop)."""
        with self.book.cond:
            if not self.should_exit() and not any(f.done() for _, f in self._starting):
                self.book.idle_wait(self.clock())

    # -- previews and decode, in the decode lane when it can ----------------------------------------------
    def _previews(self, rows: list[GroupEntry], finished: list[GroupEntry]) -> None:
        for entry in rows:
            if entry in finished or entry.request.cancel_event.is_set():
                continue
            with self.book.cond:
                pending = self.book.get(entry.request.request_id)
                sink = None if pending is None else pending.preview
            if sink is None:
                continue
            steps = preview_steps(entry.num_steps, sink.partial_images)
            step = entry.step_index - 1
            if step not in steps:
                continue
            snapshot, index = self.steps.snapshot(entry.state), steps.index(step)

            def preview(sink=sink, snapshot=snapshot, index=index, request_id=entry.request.request_id) -> None:
                try:
                    sink.deliver(index, self.steps.preview(snapshot))
                except Exception:  # a preview is best effort; the final image still follows
                    logger.exception("preview of request %s failed", request_id)

            # The lane runs jobs in order: a preview always reaches the client before its final image.
            self.decode_lane.submit(preview, inputs=[snapshot])

    def _finish(self, entries: list[GroupEntry], *, batch_size: int, call: tuple[int, int] = (0, 0)) -> None:
        """Decode the requests whose last step this was (one decoder call) and answer them; `call`: the rows and
        tokens of the step that finished them."""
        timings = [self._timing.pop(e.request.request_id, {}) for e in entries]
        for entry in entries:
            self.steps.drop(entry.request.request_id)
        self.stats.record_leave("finished", len(entries))
        group = [e.state for e in entries]
        requests = [e.request for e in entries]

        def decode() -> list[Any]:
            return self.steps.finish(group)

        # With lanes: answered from the decode lane while the loop keeps stepping the others; inline: at once.
        job = self.decode_lane.submit(decode, inputs=group, prompts=[r.params.prompt for r in requests])
        overlapped = self.lanes is not None
        job.add_done_callback(
            lambda f: self._answer(requests, f, timings, batch_size, overlapped=overlapped, call=call)
        )

    def _answer(
        self,
        requests: list[Any],
        future: Future[Any],
        timings: list[dict[str, float]],
        batch_size: int,
        *,
        overlapped: bool,
        call: tuple[int, int] = (0, 0),
    ) -> None:
        book = self.book
        try:
            side = future.result()
            if len(side.value) != len(requests):  # every request is answered, even by a decode that lost rows
                raise ValueError(f"the decode returned {len(side.value)} outputs for {len(requests)} requests")
        except Exception as exc:
            logger.error("decoding request(s) %s failed", ", ".join(r.request_id for r in requests), exc_info=exc)
            with book.cond:
                for request in requests:
                    book.answer_locked(
                        request.request_id,
                        error=GenerationError(f"Generation failed while decoding: {type(exc).__name__}: {exc}"),
                    )
            return
        if overlapped:
            self.metrics.observe_overlap("decode", side.steps_beside)
        for timing in timings:
            timing["decode"] = side.seconds
            for stage, seconds in timing.items():
                self.metrics.observe_stage(stage, seconds)
        with book.cond:
            for request, output, timing in zip(requests, side.value, timings, strict=True):
                pending = book.get(request.request_id)
                dispatched = (
                    pending.dispatched_at if pending is not None and pending.dispatched_at else request.arrival_time
                )
                self.metrics.add_outputs_generated(request.params.n)
                book.answer_locked(
                    request.request_id,
                    result=GenerationResult(
                        request_id=request.request_id,
                        output=output,
                        queue_wait_s=dispatched - request.arrival_time,
                        inference_s=self.clock() - dispatched,
                        batch_size=batch_size,
                        batch_rows=call[0],
                        batch_tokens=call[1],
                        stage_seconds=timing,
                    ),
                )
            book.cond.notify_all()

    def _fail(self, entries: list[GroupEntry], what: str) -> None:
        with self.book.cond:
            failed = self.scheduler.fail(entries)
            ids = ", ".join(e.request.request_id for e in failed)
            prefix = (
                f"The continuous denoising step of {len(failed)} requests ({ids}) failed"
                if len(failed) > 1
                else "Generation failed"
            )
            for entry in failed:
                self._timing.pop(entry.request.request_id, None)
                self.steps.drop(entry.request.request_id)
                self.book.answer_locked(entry.request.request_id, error=GenerationError(f"{prefix}: {what}"))
            self.book.cond.notify_all()
        self.stats.record_leave("failed", len(failed))


@dataclass
class InlineResult:
    """What a job run in line returned: the shape of a side lane's result (`SideResult` of `pipelines/lanes.py`)."""

    value: Any
    """The job's return value."""
    seconds: float
    """How long it ran."""
    steps_beside: int = 0
    """Denoising steps that ran beside it: none, it ran on the loop's thread."""

    def take(self, device: Any) -> Any:
        """The value (no stream to wait for)."""
        return self.value


class InlineLane:
    """A side lane that runs each job at once on the loop's thread: the lanes of a pipeline that cannot overlap."""

    def submit(self, fn: Any, *, inputs: Any = (), prompts: Any = ()) -> Future[Any]:
        future: Future[Any] = Future()
        began = time.perf_counter()
        try:
            future.set_result(InlineResult(value=fn(), seconds=time.perf_counter() - began))
        except Exception as exc:
            future.set_exception(exc)
        return future
