"""The engine loop of `--batching-mode continuous`: the step scheduler (`engine/step_scheduler.py`) driving the
resumable recipe (`pipelines/step_batch.py`) on the engine's worker thread.

Each turn: plan under the engine lock -> start the joined requests (encode + latents) -> ONE denoising step for
the whole group -> previews -> decode and answer every request whose last step it was, while the others go on
denoising at the next turn. Heads that cannot run step by step (image-conditioned requests, a family that is not
continuous) run as request-level batches through the engine's usual `_execute`.

Failures: a request whose start (encode / prepare) raises fails alone; a step that raises fails every request in
that step (they shared the one denoiser call, so none of their latents can be trusted) and the loop keeps serving.
Cancellation, deadline and disconnect remove a row at the next step boundary (`StepScheduler.plan`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from diffuserve.engine.metrics import ContinuousStats
from diffuserve.engine.scheduler import Dispatch, WaitUntil
from diffuserve.engine.step_scheduler import REMOVED_DEADLINE, GroupEntry, StepPlan, StepScheduler
from diffuserve.errors import GenerationError, RequestTimeoutError
from diffuserve.executor.worker import preview_steps
from diffuserve.pipelines import step_batch

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
        for entry in plan.joined:
            self._start(entry)
        rows = [e for e in plan.rows if e.state is not None and e in self.scheduler.group]
        if not rows:
            return
        num_rows = sum(e.num_rows for e in rows)
        self.stats.record_step(num_rows, plan.cap, len(plan.joined), plan.left, len(rows))
        engine.metrics.set_running(len(rows))
        started = time.perf_counter()
        try:
            check_step = getattr(pipeline, "check_step", None)  # operator-only fault injection (engine/faults.py)
            if check_step is not None:
                check_step([e.request.params for e in rows])
            step_batch.denoise_step(pipeline, [e.state for e in rows])  # type: ignore[arg-type]
        except Exception as exc:
            logger.exception("continuous denoising step of %d request(s) failed", len(rows))
            self._fail(rows, f"{type(exc).__name__}: {exc}")
            return
        seconds = time.perf_counter() - started
        for entry in rows:
            timing = self._timing.setdefault(entry.request.request_id, {})
            timing["denoise"] = timing.get("denoise", 0.0) + seconds
        with engine._cond:
            finished = self.scheduler.step_done(plan)
            for entry in rows:
                pending = engine._pending.get(entry.request.request_id)
                if pending is not None:
                    pending.steps_done, pending.num_steps = entry.step_index, entry.num_steps
        self._previews(rows, finished)
        for entry in finished:
            self._finish(entry, batch_size=len(rows))

    def _start(self, entry: GroupEntry) -> None:
        engine, pipeline, request = self.engine, self.engine.pipeline, entry.request
        now = engine.clock()
        engine.metrics.observe_queue_wait(now - request.arrival_time)
        with engine._cond:
            pending = engine._pending.get(request.request_id)
            if pending is not None:
                pending.dispatched_at = now
                pending.num_steps = request.params.num_inference_steps
        started = time.perf_counter()
        try:
            entry.state = step_batch.start_request(pipeline, request.params)  # type: ignore[arg-type]
        except Exception as exc:
            logger.exception("starting request %s failed", request.request_id)
            self._fail([entry], f"{type(exc).__name__}: {exc}")
            return
        # The pipeline's own schedule is what counts (it may be shorter than requested, e.g. img2img strength).
        entry.num_steps = entry.state.num_steps
        self._timing[request.request_id] = {"encode": time.perf_counter() - started}

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
            if step in steps:
                try:
                    sink.deliver(steps.index(step), step_batch.preview_request(pipeline, entry.state))  # type: ignore[arg-type]
                except Exception:  # a preview is best effort; the final image still follows
                    logger.exception("preview of request %s failed", entry.request.request_id)

    def _finish(self, entry: GroupEntry, *, batch_size: int) -> None:
        from diffuserve.engine.engine import GenerationResult

        engine, pipeline, request = self.engine, self.engine.pipeline, entry.request
        timing = self._timing.pop(request.request_id, {})
        self.stats.record_leave("finished")
        started = time.perf_counter()
        try:
            output = step_batch.finish_request(pipeline, entry.state)  # type: ignore[arg-type]
        except Exception as exc:
            logger.exception("decoding request %s failed", request.request_id)
            with engine._cond:
                engine._answer_locked(request.request_id, error=GenerationError(
                    f"Generation failed while decoding: {type(exc).__name__}: {exc}"))
            return
        timing["decode"] = time.perf_counter() - started
        for stage, seconds in timing.items():
            engine.metrics.observe_stage(stage, seconds)
        with engine._cond:
            pending = engine._pending.get(request.request_id)
            dispatched = pending.dispatched_at if pending is not None and pending.dispatched_at else request.arrival_time
            engine.metrics.add_outputs_generated(request.params.n)
            engine._answer_locked(request.request_id, result=GenerationResult(
                request_id=request.request_id,
                output=output,
                queue_wait_s=dispatched - request.arrival_time,
                inference_s=engine.clock() - dispatched,
                batch_size=batch_size,
                stage_seconds=timing,
            ))

    def _fail(self, entries: list[GroupEntry], what: str) -> None:
        engine = self.engine
        with engine._cond:
            failed = self.scheduler.fail(entries)
            ids = ", ".join(e.request.request_id for e in failed)
            prefix = (f"The continuous denoising step of {len(failed)} requests ({ids}) failed"
                      if len(failed) > 1 else "Generation failed")
            for entry in failed:
                self._timing.pop(entry.request.request_id, None)
                engine._answer_locked(entry.request.request_id, error=GenerationError(f"{prefix}: {what}"))
            engine._cond.notify_all()
        self.stats.record_leave("failed", len(failed))


def serve_continuous(engine: Any) -> None:
    """The worker thread's serving loop in continuous mode (called by `AsyncEngine._serve_forever`)."""
    ContinuousLoop(engine).run()
