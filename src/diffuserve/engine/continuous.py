"""The engine loop of `--batching-mode continuous`: the step scheduler (`engine/step_scheduler.py`) driving the
resumable recipe (`pipelines/step_batch.py`) on the engine's worker thread.

Each turn: plan under the engine lock -> hand the requests that joined to the encode lane (one shared encode +
their latents, `pipelines/overlap.py`) -> collect the starts that finished: those requests step from this
boundary on -> ONE denoising step for the ready rows -> previews and the decode of every request whose last step
it was go to the decode lane, which answers them, while the loop goes on to the next turn. Without lanes (a
pipeline that cannot overlap) the same happens inline. Heads that cannot run step by step (image-conditioned
requests, a family that is not continuous) run as request-level batches through the engine's usual `_execute`.

Failures: a request whose start (encode / prepare) raises fails alone; a step that raises fails every request in
that step (they shared the one denoiser call, so none of their latents can be trusted) and the loop keeps serving.
Cancellation, deadline and disconnect remove a row at the next step boundary (`StepScheduler.plan`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from diffuserve.engine.metrics import ContinuousStats
from diffuserve.engine.scheduler import Dispatch, WaitUntil
from diffuserve.engine.step_scheduler import REMOVED_DEADLINE, GroupEntry, StepPlan, StepScheduler
from diffuserve.errors import GenerationError, RequestTimeoutError
from diffuserve.executor.worker import preview_steps
from diffuserve.pipelines import step_batch
from diffuserve.pipelines.overlap import Overlap, SideResult, overlap_for

if TYPE_CHECKING:
    from diffuserve.engine.engine import AsyncEngine

logger = logging.getLogger("diffuserve.engine")

_MAX_IDLE_WAIT_S = 0.5
"""Upper bound on a worker sleep, so queued deadlines are checked even when nothing else happens."""


class ContinuousLoop:
    """Serves an `AsyncEngine` whose scheduler is a `StepScheduler` until the engine stops."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        assert isinstance(engine.scheduler, StepScheduler)
        self.scheduler: StepScheduler = engine.scheduler
        stats = engine.batching_stats
        self.stats = ContinuousStats(engine.metrics, log_enabled=bool(stats is not None and stats.log_enabled))
        self._timing: dict[str, dict[str, float]] = {}
        """request id -> its stage seconds (encode / denoise / decode) so far."""
        pipeline = engine.pipeline
        self.overlap: Overlap | None = overlap_for(pipeline) if getattr(pipeline, "defers_decode", False) else None
        """The side lanes (encode, decode) of a native pipeline; None = start and decode inline."""
        self._starting: list[tuple[list[GroupEntry], Future[SideResult[list[Any]]]]] = []
        """Entries that joined at one boundary and their start (encode + latents), running or not collected yet."""
        self._left = 0
        """Requests that left since the last step line."""
        self.steps = engine.executor.steps()
        """Start / step / drop on every rank of the replica (one rank: the pipeline itself)."""

    def run(self) -> None:
        engine = self.engine
        while True:
            decision = self._next()
            if decision is None:
                return
            if isinstance(decision, Dispatch):
                engine._run_guarded(decision.batch)
                continue
            try:
                self._turn(decision)
            except Exception as exc:  # the loop never dies: fail what is still in the group, keep serving
                logger.exception("internal error around a continuous denoising step")
                self._fail(self.scheduler.group, f"internal error: {type(exc).__name__}: {exc}")

    # -- scheduling ---------------------------------------------------------------------------------------
    def _next(self) -> Dispatch | StepPlan | None:
        engine, scheduler = self.engine, self.scheduler
        with engine._cond:
            while True:
                if engine._stop:
                    return None
                now = engine.clock()
                for request in scheduler.expire(now):
                    engine._answer_locked(request.request_id, error=RequestTimeoutError(
                        "The request waited in the queue past its deadline and was not run."))
                decision = scheduler.plan(now)
                engine.metrics.set_queue_depth(scheduler.num_queued)
                if isinstance(decision, StepPlan):
                    for request, reason in decision.removed:
                        self._timing.pop(request.request_id, None)
                        self.steps.drop(request.request_id)
                        self.stats.record_leave(reason)
                        if reason == REMOVED_DEADLINE:
                            engine._answer_locked(request.request_id, error=RequestTimeoutError(
                                "The request ran past its deadline and was removed from the denoise group."))
                        # cancelled rows were answered when they were cancelled (abort / fail_all)
                    return decision
                if isinstance(decision, Dispatch):
                    return decision
                self.stats.set_idle()
                engine.metrics.set_running(0)
                wake_at = [t for t in (scheduler.next_deadline(),
                                       decision.time if isinstance(decision, WaitUntil) else None) if t is not None]
                engine._cond.wait(min([_MAX_IDLE_WAIT_S, *(max(0.0, t - now) for t in wake_at)]))

    # -- one turn -----------------------------------------------------------------------------------------
    def _turn(self, plan: StepPlan) -> None:
        engine, pipeline = self.engine, self.engine.pipeline
        assert pipeline is not None
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
        self.stats.record_step(num_rows, plan.cap, joined, self._left, len(rows))
        self._left = 0
        engine.metrics.set_running(len(rows))
        started = time.perf_counter()
        try:
            check_step = getattr(pipeline, "check_step", None)  # operator-only fault injection (engine/faults.py)
            if check_step is not None:
                check_step([e.request.params for e in rows])
            self.steps.step([(e.request.request_id, e.state) for e in rows])
        except Exception as exc:
            logger.exception("continuous denoising step of %d request(s) failed", len(rows))
            self._fail(rows, f"{type(exc).__name__}: {exc}")
            return
        if self.overlap is not None:
            self.overlap.count_step()
        seconds = time.perf_counter() - started
        for entry in rows:
            timing = self._timing.setdefault(entry.request.request_id, {})
            timing["denoise"] = timing.get("denoise", 0.0) + seconds
        with engine._cond:
            finished = self.scheduler.step_done(plan, rows)
            for entry in rows:
                pending = engine._pending.get(entry.request.request_id)
                if pending is not None:
                    pending.steps_done, pending.num_steps = entry.step_index, entry.num_steps
        self._previews(rows, finished)
        if finished:
            # batch_rows: the rows of the step that finished them (was always 0 in continuous mode).
            self._finish(finished, batch_size=len(rows), batch_rows=sum(e.num_rows for e in rows))

    # -- starting (encode + latents), beside the loop when it can -----------------------------------------
    def _start(self, entries: list[GroupEntry]) -> None:
        """Start the requests that joined at this boundary: one encode-lane job for all of them."""
        engine = self.engine
        now = engine.clock()
        with engine._cond:
            for entry in entries:
                request = entry.request
                engine.metrics.observe_queue_wait(now - request.arrival_time)
                pending = engine._pending.get(request.request_id)
                if pending is not None:
                    pending.dispatched_at = now
                    pending.num_steps = request.params.num_inference_steps
                entry.ready = False
        batch = [e.request.params for e in entries]
        ids = [e.request.request_id for e in entries]

        def start() -> list[Any]:  # shared encoder calls; a request whose start raises fails alone
            return self.steps.start(list(zip(ids, batch, strict=True)))

        if self.overlap is None:
            future: Future[SideResult[list[Any]]] = Future()
            began = time.perf_counter()
            try:
                future.set_result(SideResult(value=start(), seconds=time.perf_counter() - began, steps_beside=0))
            except Exception as exc:
                future.set_exception(exc)
        else:
            future = self.overlap.encode.submit(start, prompts=[p.prompt for p in batch])
            future.add_done_callback(lambda _: self._wake())
        self._starting.append((entries, future))

    def _wake(self) -> None:
        with self.engine._cond:
            self.engine._cond.notify_all()

    def _collect_started(self) -> int:
        """Entries whose start finished become ready (they step from this boundary on); returns how many."""
        engine, joined = self.engine, 0
        for item in [item for item in self._starting if item[1].done()]:
            self._starting.remove(item)
            entries, future = item
            try:
                side = future.result()
                # CUDA: the loop's stream waits for the encode lane's before using the rows it made.
                results = side.take(engine.pipeline.device) if self.overlap is not None else side.value  # type: ignore[union-attr]
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
            if side is not None and self.overlap is not None:
                engine.metrics.observe_overlap("encode", side.steps_beside)
        return joined

    def _wait_for_starts(self) -> None:
        """Nothing is ready to step: sleep until a start finishes (or a request arrives, or the stop)."""
        engine = self.engine
        with engine._cond:
            if not engine._stop and not any(f.done() for _, f in self._starting):
                engine._cond.wait(_MAX_IDLE_WAIT_S)

    # -- previews and decode, in the decode lane when it can ----------------------------------------------
    def _previews(self, rows: list[GroupEntry], finished: list[GroupEntry]) -> None:
        engine, pipeline = self.engine, self.engine.pipeline
        for entry in rows:
            if entry in finished or entry.request.cancel_event.is_set():
                continue
            pending = engine._pending.get(entry.request.request_id)
            sink = None if pending is None else pending.preview
            if sink is None:
                continue
            steps = preview_steps(entry.num_steps, sink.partial_images)
            step = entry.step_index - 1
            if step not in steps:
                continue
            snapshot, index = step_batch.snapshot(entry.state), steps.index(step)

            def preview(sink=sink, snapshot=snapshot, index=index, request_id=entry.request.request_id) -> None:
                try:
                    sink.deliver(index, step_batch.preview_request(pipeline, snapshot))  # type: ignore[arg-type]
                except Exception:  # a preview is best effort; the final image still follows
                    logger.exception("preview of request %s failed", request_id)

            if self.overlap is None:
                preview()
            else:  # the lane runs jobs in order: a preview always reaches the client before its final image
                self.overlap.decode.submit(preview, inputs=[snapshot])

    def _finish(self, entries: list[GroupEntry], *, batch_size: int, batch_rows: int = 0) -> None:
        """Decode the requests whose last step this was (one decoder call) and answer them."""
        timings = [self._timing.pop(e.request.request_id, {}) for e in entries]
        for entry in entries:
            self.steps.drop(entry.request.request_id)
        self.stats.record_leave("finished", len(entries))
        pipeline, group = self.engine.pipeline, [e.state for e in entries]
        requests = [e.request for e in entries]

        def decode() -> list[Any]:
            return step_batch.finish_requests(pipeline, group)  # type: ignore[arg-type]

        if self.overlap is None:
            future: Future[SideResult[list[Any]]] = Future()
            began = time.perf_counter()
            try:
                future.set_result(SideResult(value=decode(), seconds=time.perf_counter() - began, steps_beside=0))
            except Exception as exc:
                future.set_exception(exc)
            self._answer(requests, future, timings, batch_size, overlapped=False, batch_rows=batch_rows)
        else:  # answered from the decode lane while the loop keeps stepping the others
            job = self.overlap.decode.submit(decode, inputs=group, prompts=[r.params.prompt for r in requests])
            job.add_done_callback(lambda f: self._answer(requests, f, timings, batch_size, overlapped=True,
                                                         batch_rows=batch_rows))

    def _answer(self, requests: list[Any], future: Future[SideResult[list[Any]]], timings: list[dict[str, float]],
                batch_size: int, *, overlapped: bool, batch_rows: int = 0) -> None:
        from diffuserve.engine.engine import GenerationResult

        engine = self.engine
        try:
            side = future.result()
            if len(side.value) != len(requests):  # every request is answered, even by a decode that lost rows
                raise ValueError(f"the decode returned {len(side.value)} outputs for {len(requests)} requests")
        except Exception as exc:
            logger.error("decoding request(s) %s failed", ", ".join(r.request_id for r in requests), exc_info=exc)
            with engine._cond:
                for request in requests:
                    engine._answer_locked(request.request_id, error=GenerationError(
                        f"Generation failed while decoding: {type(exc).__name__}: {exc}"))
            return
        if overlapped:
            engine.metrics.observe_overlap("decode", side.steps_beside)
        for timing in timings:
            timing["decode"] = side.seconds
            for stage, seconds in timing.items():
                engine.metrics.observe_stage(stage, seconds)
        with engine._cond:
            for request, output, timing in zip(requests, side.value, timings, strict=True):
                pending = engine._pending.get(request.request_id)
                dispatched = (pending.dispatched_at if pending is not None and pending.dispatched_at
                              else request.arrival_time)
                engine.metrics.add_outputs_generated(request.params.n)
                engine._answer_locked(request.request_id, result=GenerationResult(
                    request_id=request.request_id,
                    output=output,
                    queue_wait_s=dispatched - request.arrival_time,
                    inference_s=engine.clock() - dispatched,
                    batch_size=batch_size,
                    batch_rows=batch_rows,
                    stage_seconds=timing,
                ))
            engine._cond.notify_all()

    def _fail(self, entries: list[GroupEntry], what: str) -> None:
        engine = self.engine
        with engine._cond:
            failed = self.scheduler.fail(entries)
            ids = ", ".join(e.request.request_id for e in failed)
            prefix = (f"The continuous denoising step of {len(failed)} requests ({ids}) failed"
                      if len(failed) > 1 else "Generation failed")
            for entry in failed:
                self._timing.pop(entry.request.request_id, None)
                self.steps.drop(entry.request.request_id)
                engine._answer_locked(entry.request.request_id, error=GenerationError(f"{prefix}: {what}"))
            engine._cond.notify_all()
        self.stats.record_leave("failed", len(failed))


def serve_continuous(engine: Any) -> None:
    """The worker thread's serving loop in continuous mode (called by `AsyncEngine._serve_forever`)."""
    ContinuousLoop(engine).run()
