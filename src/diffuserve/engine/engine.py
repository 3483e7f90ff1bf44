"""AsyncEngine: the asyncio facade over the pure scheduler and one worker thread.

The event loop submits requests and awaits one future per request; the worker thread loads the
model through the `Executor` (executor/base.py), warms it up, then loops: schedule -> execute (one batch,
on one replica) -> update (answer its requests). With data-parallel replicas there is one such loop per
replica, sharing the scheduler; a batch is formed only when a replica is free, and goes to the free replica
that has produced the fewest rows. Every accepted request is answered exactly once (success, error,
timeout, cancel, shutdown or a rank fault), and nothing the pipeline raises stops the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diffuserve.config.engine_limits import EngineConfig  # owned by config/; re-exported
from diffuserve.engine.metrics import BatchingStats, EngineMetrics
from diffuserve.engine.request import Request, RequestStatus
from diffuserve.engine.scheduler import Dispatch, DynamicBatcher, WaitUntil
from diffuserve.errors import (
    DiffuserveError,
    GenerationError,
    QueueFullError,
    RequestCancelledError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from diffuserve.executor.base import BatchCall, Executor, InProcessExecutor
from diffuserve.executor.worker import BatchOutcome, PreviewSink
from diffuserve.pipelines.base import Pipeline, RequestOutput
from diffuserve.sampling import ModelDescription, SamplingParams, build_sampling_params

logger = logging.getLogger("diffuserve.engine")

_MAX_IDLE_WAIT_S = 0.5
"""Upper bound on a worker sleep, so queued deadlines are checked even when nothing else happens."""


def _warmup_images(model: ModelDescription, width: int, height: int) -> tuple[bytes, ...]:
    """The input images a warm-up request of an edit-only model carries: plain gray PNGs at its size."""
    if not model.min_image_inputs:
        return ()
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(buffer, "PNG")
    return (buffer.getvalue(),) * model.min_image_inputs


class EngineState(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class GenerationResult:
    """The answer to one request."""

    request_id: str
    output: RequestOutput
    queue_wait_s: float
    inference_s: float
    batch_size: int
    """Requests in the pipeline batch this request ran in (kept for compatibility: = batch_requests)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    batch_rows: int = 0
    """Rows of the (largest) pipeline call this request ran in; at most the row cap."""
    pipeline_calls: int = 1
    """Pipeline calls its batch ran as (> 1 when a request's n was above --batching-max-size)."""

    @property
    def batch_requests(self) -> int:
        """Requests in the batch this request ran in."""
        return self.batch_size


@dataclass(eq=False)
class _Pending:
    request: Request
    future: asyncio.Future[GenerationResult]
    loop: asyncio.AbstractEventLoop
    endpoint: str
    answered: bool = False
    dispatched_at: float | None = None
    num_steps: int | None = None
    """Denoising steps of the batch it runs in; None while queued."""
    steps_done: int = 0
    """Denoising steps finished so far (updated at every step boundary)."""
    preview: PreviewSink | None = None
    """Where the request's partial images go (streaming requests); None = no previews."""


class AsyncEngine:
    """Owns the scheduler, the worker thread and the per-request futures."""

    def __init__(
        self,
        executor: Executor | Callable[[], Pipeline],
        scheduler: DynamicBatcher,
        *,
        config: EngineConfig | None = None,
        metrics: EngineMetrics | None = None,
        batching_stats: BatchingStats | None = None,
        model_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        # A bare loader is the one-rank case.
        self.executor: Executor = executor if hasattr(executor, "execute") else InProcessExecutor(executor, clock=clock)  # type: ignore[arg-type]
        self.scheduler = scheduler
        self.config = config or EngineConfig()
        self.metrics = metrics or EngineMetrics()
        self.batching_stats = batching_stats
        self.model_name = model_name
        self.clock = clock
        self.pipeline: Pipeline | None = None
        self.state = EngineState.LOADING
        self.failure: str | None = None
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ready_event = threading.Event()
        self.on_fatal: Callable[[str], None] | None = None
        """Called (from the worker thread) when load or warm-up fails; `serve` uses it to exit non-zero."""
        self._recent_batch_s: float | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the worker thread: load, warm up, then serve. Returns at once."""
        self._thread = threading.Thread(target=self._worker_main, name="diffuserve-worker", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready_event.wait(timeout)
        return self.state == EngineState.READY

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def begin_drain(self) -> None:
        """Stop admitting (health 503, new requests 503); accepted requests keep running."""
        with self._cond:
            if self.state in (EngineState.READY, EngineState.LOADING, EngineState.WARMING_UP):
                self.state = EngineState.DRAINING
            self._cond.notify_all()

    async def drain(self, timeout_s: float) -> int:
        """Wait for every accepted request to be answered; past the timeout answer the rest with 503.

        Returns how many requests had to be failed.
        """
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self.num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failed = self.fail_all(ServiceUnavailableError("The server shut down before this request finished; retry on another replica."))
        # Let the answers reach their handlers before the caller tears the server down.
        await asyncio.sleep(0.05)
        return failed

    def fail_all(self, error: DiffuserveError) -> int:
        """Answer every request not answered yet with `error` (queued ones never run; running ones stop
        at the next step). Returns how many were answered."""
        with self._cond:
            self.scheduler.drain()  # queued requests must never start
            unanswered = [p for p in self._pending.values() if not p.answered]
            for pending in unanswered:
                pending.request.cancel_event.set()
                self._answer_locked(pending.request.request_id, error=error)
            return len(unanswered)

    def fail_rank(self, message: str) -> None:
        """A rank died or hung: answer everything with an error naming it, turn /health 503, and ask the server
        to exit non-zero (`on_fatal`) so the orchestrator restarts the whole group. Called from any thread."""
        with self._cond:
            if self.state == EngineState.FAILED:
                return
            self.state = EngineState.FAILED
            self.failure = message
            self._cond.notify_all()
        failed = self.fail_all(GenerationError(f"{message}; this request was not finished. The server is restarting; retry."))
        logger.error("%s: answered %d request(s) with an error; exiting", message, failed)
        self._ready_event.set()
        if self.on_fatal is not None:
            self.on_fatal(message)

    def stop_before_serving(self) -> bool:
        """Stop a load or warm-up that has not finished: True (and the engine never turns ready) when it had
        not served yet; False once it serves (then drain). `serve` calls it from its signal handler."""
        with self._cond:
            if self.state not in (EngineState.LOADING, EngineState.WARMING_UP):
                return False
            self._stop = True
            self.state = EngineState.STOPPED
            self._cond.notify_all()
            return True

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self.state = EngineState.STOPPED
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- submission
    async def generate(
        self,
        params: SamplingParams,
        *,
        endpoint: str = "images",
        timeout_s: float | None = None,
        priority: int = 0,
        ineligible_reason: str | None = None,
        request_id: str | None = None,
        preview: PreviewSink | None = None,
    ) -> GenerationResult:
        """Submit and await one request. Cancelling the awaiting task aborts the request."""
        pending = self._admit(params, asyncio.get_running_loop(), endpoint, timeout_s, priority,
                              ineligible_reason, request_id, preview)
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            self.abort(pending.request.request_id)
            raise

    def submit(
        self,
        params: SamplingParams,
        *,
        endpoint: str = "images",
        timeout_s: float | None = None,
        priority: int = 0,
        ineligible_reason: str | None = None,
        request_id: str | None = None,
        preview: PreviewSink | None = None,
    ) -> asyncio.Future[GenerationResult]:
        """Admit one request now (raising 429/503 errors at once) and return the future of its answer.

        For callers that outlive the HTTP request (video jobs); `generate` is submit + await.
        """
        return self._admit(params, asyncio.get_running_loop(), endpoint, timeout_s, priority,
                           ineligible_reason, request_id, preview).future

    def _admit(self, params, loop, endpoint, timeout_s, priority, ineligible_reason, request_id,
               preview=None) -> _Pending:
        with self._cond:
            if self.state != EngineState.READY and ineligible_reason != "warmup":
                raise self.not_ready_error()
            limit = self.config.max_queue_size
            if limit and self.scheduler.num_queued >= limit:
                self.metrics.observe_request(endpoint, "rejected", 0.0)
                raise QueueFullError(
                    f"The queue is full ({self.scheduler.num_queued} requests waiting, --max-queue-size {limit}); retry later.",
                    retry_after_s=self._retry_after_s(),
                )
            now = self.clock()
            # The request's own timeout may only shorten the server's deadline.
            limits = [t for t in (timeout_s, self.config.request_timeout_s) if t]
            chosen = min(limits) if limits else None
            request = Request(
                request_id=request_id or uuid.uuid4().hex,
                params=params,
                arrival_time=now,
                model=self.model_name,
                ineligible_reason=ineligible_reason,
                priority=priority,
                deadline=now + chosen if chosen else None,
            )
            future: asyncio.Future[GenerationResult] = loop.create_future()
            # An aborted request's error is delivered to a future nobody awaits any more; mark it seen.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            pending = _Pending(request=request, future=future, loop=loop, endpoint=endpoint, preview=preview)
            self._pending[request.request_id] = pending
            self.scheduler.add(request)
            self._maybe_prefetch(request)
            self.metrics.set_queue_depth(self.scheduler.num_queued)
            self._cond.notify_all()
            return pending

    def _maybe_prefetch(self, request: Request) -> None:
        """Dynamic batching, one rank: a request queued behind a running batch has its texts encoded in the
        encode lane meanwhile (`pipelines/text_prefetch.py`), so its own batch starts at the denoise loop. Caller
        holds the lock."""
        prefetch = getattr(self.pipeline, "prefetch_text", None)
        if (prefetch is None or not isinstance(self.executor, InProcessExecutor) or not self.scheduler.config.dynamic
                or hasattr(self.scheduler, "supports_continuous") or not self.scheduler.num_running
                or request.ineligible_reason == "warmup"):
            return
        try:
            prefetch(request.params, on_done=lambda steps: self.metrics.observe_overlap("encode", steps))
        except Exception:  # an optimisation: the batch encodes the text itself
            logger.warning("could not prefetch the text encode of %s", request.request_id, exc_info=True)

    def abort(self, request_id: str, error: DiffuserveError | None = None) -> None:
        """The client went away: drop a queued request, or cancel a running one at the next step."""
        error = error or RequestCancelledError("The client disconnected; the request was cancelled.")
        with self._cond:
            pending = self._pending.get(request_id)
            if pending is None or pending.answered:
                return
            pending.request.cancel_event.set()
            if self.scheduler.abort(request_id) is not None:
                self.metrics.inc_cancelled_before_run()
                self.metrics.set_queue_depth(self.scheduler.num_queued)
            self._answer_locked(request_id, error=error)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request; None while queued, or once answered/unknown."""
        with self._cond:
            pending = self._pending.get(request_id)
            if pending is None or pending.num_steps is None:
                return None
            return pending.steps_done, pending.num_steps

    def _retry_after_s(self) -> float:
        """A hint for 429s: the queue drains at about one batch per recent batch time."""
        per_batch = self._recent_batch_s or 1.0
        batches = self.scheduler.num_queued / max(1, self.scheduler.config.max_size)
        return max(1.0, round(per_batch * batches, 1))

    @property
    def model(self) -> ModelDescription | None:
        """What the routes need to know about the served model (None until it is loaded)."""
        return self.pipeline.describe_model() if self.pipeline is not None else None

    def not_ready_error(self) -> ServiceUnavailableError:
        if self.state == EngineState.DRAINING:
            return ServiceUnavailableError("The server is shutting down and accepts no new requests.", retry_after_s=5)
        if self.state == EngineState.FAILED:
            return ServiceUnavailableError(f"The server is out of service: {self.failure}")
        return ServiceUnavailableError(
            f"The model is not ready yet ({self.state.value}); poll GET /health until it returns 200.",
            retry_after_s=5,
        )

    # ---------------------------------------------------------------- answering
    def _answer_locked(self, request_id: str, *, result: GenerationResult | None = None, error: DiffuserveError | None = None) -> None:
        """Answer exactly once (caller holds the lock)."""
        pending = self._pending.pop(request_id, None)
        if pending is None or pending.answered:
            return
        pending.answered = True
        request = pending.request
        latency = self.clock() - request.arrival_time
        if error is None:
            request.status = RequestStatus.FINISHED
            status = "success"
        else:
            request.status = {
                RequestTimeoutError: RequestStatus.TIMED_OUT,
                RequestCancelledError: RequestStatus.ABORTED,
            }.get(type(error), RequestStatus.FAILED)
            status = {RequestStatus.TIMED_OUT: "timeout", RequestStatus.ABORTED: "cancelled"}.get(request.status, "error")
        if request.ineligible_reason != "warmup":
            self.metrics.observe_request(pending.endpoint, status, latency)

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

    # ---------------------------------------------------------------- worker thread
    def _worker_main(self) -> None:
        try:
            self._load_and_warm_up()
        except Exception as exc:
            message = exc.message if isinstance(exc, DiffuserveError) else f"{type(exc).__name__}: {exc}"
            logger.error("model load / warm-up failed: %s", message, exc_info=not isinstance(exc, DiffuserveError))
            with self._cond:
                self.state = EngineState.FAILED
                self.failure = message
            self._ready_event.set()
            if self.on_fatal is not None:
                self.on_fatal(f"the model failed to load: {message}")
            return
        self._ready_event.set()
        self._serve_forever()

    def _load_and_warm_up(self) -> None:
        started = time.monotonic()
        self.pipeline = self.executor.load()
        # What the loaded model can do decides what the scheduler may merge.
        self.scheduler.supports_batching = self.pipeline.supports_batching
        if hasattr(self.scheduler, "supports_continuous"):  # --batching-mode continuous
            self.scheduler.supports_continuous = self.pipeline.supports_continuous
        logger.info("model loaded in %.1fs: %s", time.monotonic() - started, self.pipeline.describe())
        if self.config.enable_warmup:
            with self._cond:
                self.state = EngineState.WARMING_UP
            # Under --enable-torch-compile with --offload-during-compile the residency layer offloads the
            # DiT and evicts resident components while compiling; leaving restores the serving residency.
            with self.pipeline.residency.compile_warmup():
                self._run_warmup()
        with self._cond:
            if self.state not in (EngineState.LOADING, EngineState.WARMING_UP):
                return  # told to stop (or drain) before it served: never "ready"
            self.state = EngineState.READY
        logger.info("ready to serve after %.1fs", time.monotonic() - started)

    def _run_warmup(self) -> None:
        """One real generation per warm-up size (the default, then each --warmup-resolutions entry)."""
        assert self.pipeline is not None
        model = self.pipeline.describe_model()
        sizes = [(model.defaults.width, model.defaults.height)]
        sizes += [s for s in self.config.warmup_resolutions if s not in sizes]
        for replica in range(len(self.executor.replicas)):
            for width, height in sizes:
                params = build_sampling_params(model, prompt="warm-up", width=width, height=height,
                                               num_inference_steps=self.config.warmup_steps, seed=0,
                                               image_inputs=_warmup_images(model, width, height))
                started = time.monotonic()
                request = Request(request_id="warmup", params=params, arrival_time=self.clock(), ineligible_reason="warmup")
                outcome = self.executor.execute(replica, BatchCall([request]))
                if outcome.errors:
                    raise RuntimeError(f"warm-up generation at {width}x{height} failed: {outcome.errors['warmup'].message}")
                where = f" on replica {replica}" if len(self.executor.replicas) > 1 else ""
                logger.info("warm-up generation (%dx%d, %d steps)%s took %.2fs", width, height,
                            params.num_inference_steps, where, time.monotonic() - started)

    def _serve_forever(self) -> None:
        from diffuserve.engine.step_scheduler import StepScheduler

        if isinstance(self.scheduler, StepScheduler):  # --batching-mode continuous: the step-level loop
            from diffuserve.engine.continuous import serve_continuous

            serve_continuous(self)
            return
        for replica in range(1, len(self.executor.replicas)):
            threading.Thread(target=self._replica_loop, args=(replica,), name=f"diffuserve-replica-{replica}",
                             daemon=True).start()
        self._replica_loop(0)

    def _replica_loop(self, replica: int) -> None:
        """schedule -> execute -> update, for one replica, until the engine stops."""
        while True:
            batch = self._next_batch(replica)
            if batch is None:
                return
            self._run_guarded(batch, replica)

    def _run_guarded(self, batch: Any, replica: int = 0) -> None:
        """Run one request-level batch; whatever it raises answers its requests and frees the scheduler."""
        try:
            self._execute(batch, replica)
        except Exception as exc:  # the batch loop never dies: answer the batch, free the scheduler
            logger.exception("internal error around a batch")
            error = GenerationError(f"Internal error while running this batch: {type(exc).__name__}: {exc}")
            with self._cond:
                for request in batch.requests:
                    self._answer_locked(request.request_id, error=error)
                if self.scheduler.is_running(batch):
                    self.scheduler.complete(batch)
                self._replica_done(replica, 0)
                self._cond.notify_all()

    def _my_turn(self, replica: int) -> bool:
        """Whether `replica` is the free replica that should take the next batch: the one that has produced the
        fewest rows (then the lowest index), so load spreads over replicas instead of going round-robin."""
        free = [s for s in self.executor.replicas if not s.busy and s.failed is None]
        return bool(free) and min(free, key=lambda s: (s.rows, s.replica)).replica == replica

    def _replica_done(self, replica: int, rows: int) -> None:
        """Caller holds the lock."""
        state = self.executor.replicas[replica]
        state.busy = False
        state.batches += 1
        state.rows += rows
        self.metrics.set_running(sum(len(b.requests) for b in self.scheduler.running_batches))
        self.metrics.observe_replica(state)

    def _next_batch(self, replica: int = 0) -> Any:
        with self._cond:
            while True:
                if self._stop or self.state == EngineState.FAILED:
                    return None
                if not self._my_turn(replica):
                    self._cond.wait(_MAX_IDLE_WAIT_S)
                    continue
                now = self.clock()
                for request in self.scheduler.expire(now):
                    self._answer_locked(request.request_id, error=RequestTimeoutError(
                        "The request waited in the queue past its deadline and was not run."))
                action = self.scheduler.schedule(now)
                self.metrics.set_queue_depth(self.scheduler.num_queued)
                if isinstance(action, Dispatch):
                    self.executor.replicas[replica].busy = True
                    self.metrics.observe_replica(self.executor.replicas[replica])
                    self._cond.notify_all()  # the next free replica may schedule now
                    return action.batch
                wake_at = [t for t in (self.scheduler.next_deadline(),
                                       action.time if isinstance(action, WaitUntil) else None) if t is not None]
                wait = min([_MAX_IDLE_WAIT_S, *(max(0.0, t - now) for t in wake_at)])
                self._cond.wait(wait)

    def _execute(self, batch: Any, replica: int = 0) -> None:
        assert self.pipeline is not None
        requests: list[Request] = list(batch.requests)
        if self.batching_stats is not None:
            self.batching_stats.record(batch)
        started = self.clock()
        for request in requests:
            self.metrics.observe_queue_wait(started - request.arrival_time)
        with self._cond:
            self.metrics.set_running(sum(len(b.requests) for b in self.scheduler.running_batches))
        previews: dict[str, PreviewSink] = {}
        with self._cond:
            for request in requests:
                pending = self._pending.get(request.request_id)
                if pending is not None:
                    pending.dispatched_at = started
                    pending.num_steps = request.params.num_inference_steps
                    if pending.preview is not None:
                        previews[request.request_id] = pending.preview

        def on_step(step: int, num_steps: int) -> None:
            # Step boundary: requests past their deadline are answered 504 now; the batch goes on
            # for the others (and stops when nobody in it still waits).
            now = self.clock()
            with self._cond:
                for request in requests:
                    pending = self._pending.get(request.request_id)
                    if pending is not None:
                        pending.steps_done, pending.num_steps = step + 1, num_steps
                    if request.deadline is not None and now > request.deadline and not request.cancel_event.is_set():
                        request.cancel_event.set()
                        self._answer_locked(request.request_id, error=RequestTimeoutError(
                            f"The request ran past its deadline and was cancelled at step {step + 1}/{num_steps}."))

        # The row cap is a hard cap on every pipeline call in dynamic mode (operators size it to the
        # device): an oversized request the scheduler dispatched alone runs as several calls.
        max_rows = batch.effective_cap if self.scheduler.config.dynamic else None

        def answer(outcome: BatchOutcome) -> None:
            for stage, seconds in outcome.stage_seconds.items():
                self.metrics.observe_stage(stage, seconds)
            if outcome.deferred:
                self.metrics.observe_overlap("decode", outcome.decode_overlap_steps)
            with self._cond:
                for request in requests:
                    rid = request.request_id
                    if rid in outcome.outputs:
                        self.metrics.add_outputs_generated(request.params.n)
                        self._answer_locked(rid, result=GenerationResult(
                            request_id=rid,
                            output=outcome.outputs[rid],
                            queue_wait_s=started - request.arrival_time,
                            inference_s=outcome.inference_seconds,
                            batch_size=len(requests),
                            stage_seconds=outcome.stage_seconds,
                            batch_rows=outcome.batch_rows,
                            pipeline_calls=outcome.pipeline_calls,
                        ))
                    else:
                        self._answer_locked(rid, error=outcome.errors.get(rid) or RequestCancelledError("cancelled"))
                self._cond.notify_all()

        # Overlap (dynamic / continuous): the batch's decode runs in the decode lane and `answer` is called from
        # there, while this thread frees the scheduler and starts the next batch (executor/worker.py `run_batch`).
        overlap = self.scheduler.config.mode in ("dynamic", "continuous")
        outcome = self.executor.execute(replica, BatchCall(requests, on_step=on_step, previews=previews,
                                                           max_rows=max_rows,
                                                           on_decoded=answer if overlap else None))
        self._recent_batch_s = outcome.inference_seconds
        if not outcome.deferred:
            answer(outcome)
        with self._cond:
            self.scheduler.complete(batch)
            produced = (outcome.batch_rows if outcome.deferred
                        else sum(r.params.n for r in requests if r.request_id in outcome.outputs))
            self._replica_done(replica, produced)
            self._cond.notify_all()
