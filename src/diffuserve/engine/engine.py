"""AsyncEngine: the asyncio facade over the pure scheduler, the request book and one serving loop.

The event loop admits requests (429 / 503 here) into the request book (`engine/request_book.py`) and awaits one
future per request; the worker thread loads the model through the `Executor` (executor/base.py), warms it up, then
runs the ONE loop its batching mode picks: `BatchLoop` (`engine/batch_loop.py`: schedule -> execute one batch on a
free replica -> answer) for singleton and dynamic batching, `StepLoop` (`engine/step_loop.py`: requests join and
leave a running denoise group at step boundaries) for continuous batching. Every accepted request is answered
exactly once (success, error, timeout, cancel, shutdown or a rank fault), and nothing the pipeline raises stops
the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from diffuserve.activation import ActivationFacts, check_fits, estimate_bytes
from diffuserve.config.batching import BatchingMode
from diffuserve.config.engine import EngineConfig  # owned by config/; re-exported
from diffuserve.engine.batch_loop import BatchLoop
from diffuserve.engine.metrics import BatchingStats, EngineMetrics
from diffuserve.engine.request import Request
from diffuserve.engine.request_book import GenerationResult, PendingRequest, RequestBook
from diffuserve.engine.scheduler_protocol import RequestScheduler
from diffuserve.engine.status import EngineState, EngineStatus, engine_status, not_ready_error
from diffuserve.engine.step_loop import StepLoop
from diffuserve.engine.step_scheduler import StepScheduler
from diffuserve.engine.token_costs import FALLBACK_TOKEN_SIDE, TokenCounter, model_token_budget
from diffuserve.errors import (
    DiffuserveError,
    GenerationError,
    QueueFullError,
    RequestCancelledError,
    ServiceUnavailableError,
)
from diffuserve.executor.base import Executor, ServingPipeline
from diffuserve.executor.batch_runner import NoEvents
from diffuserve.executor.messages import BatchMessage, PreviewSink
from diffuserve.sampling import ModelDescription, SamplingParams, build_sampling_params

logger = logging.getLogger("diffuserve.engine")

__all__ = ["AsyncEngine", "EngineConfig", "EngineState", "EngineStatus", "GenerationResult", "not_ready_error"]


def _warmup_images(model: ModelDescription, width: int, height: int) -> tuple[bytes, ...]:
    """The input images a warm-up request of an edit-only model carries: plain gray PNGs at its size."""
    if not model.min_image_inputs:
        return ()
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(buffer, "PNG")
    return (buffer.getvalue(),) * model.min_image_inputs


class AsyncEngine:
    """Admission, lifecycle and warm-up; owns the request book, the scheduler and the worker thread."""

    def __init__(
        self,
        executor: Executor,
        scheduler: RequestScheduler,
        *,
        config: EngineConfig | None = None,
        metrics: EngineMetrics | None = None,
        batching_stats: BatchingStats | None = None,
        model_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.executor = executor
        """Runs the batches: `InProcessExecutor` for one rank, `MultiRankExecutor` for several."""
        self.scheduler = scheduler
        """A `RequestScheduler` (engine/scheduler_protocol.py): `RequestLevelScheduler` (singleton / dynamic) or
        `StepScheduler` (continuous)."""
        self.mode = BatchingMode(scheduler.config.mode)
        """The batching mode: decides the serving loop, once."""
        self.config = config or EngineConfig()
        self.metrics = metrics or EngineMetrics()
        self.model_name = model_name
        self.clock = clock
        self.book = RequestBook(self.metrics, clock)
        """Pending requests, answer-once, abort, progress; its `cond` is the engine's one lock."""
        self._cond = self.book.cond
        self.pipeline: ServingPipeline | None = None
        """Rank 0's serving pipeline, once loaded (its capabilities and model description)."""
        self.state = EngineState.LOADING
        self.failure: str | None = None
        self.load_error: Exception | None = None
        """What the model load / warm-up raised (FAILED before serving); `generate` re-raises it as it was."""
        self.ready_line: str | None = "ready to serve"
        """Logged (with the start-up time) once READY; None logs nothing (`generate`, which serves nobody)."""
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ready_event = threading.Event()
        self.on_fatal: Callable[[str], None] | None = None
        """Called (from the worker thread) when load or warm-up fails; `serve` uses it to exit non-zero."""
        self._activation_facts: ActivationFacts | None = None
        self._row_tokens = TokenCounter(FALLBACK_TOKEN_SIDE)  # Request.row_tokens: the served model's once loaded
        """The served checkpoint's activation facts, once loaded (None before: nothing is admitted then)."""
        self._batches = BatchLoop(
            self.book,
            scheduler,
            self.executor,
            metrics=self.metrics,
            batching_stats=batching_stats,
            clock=clock,
            should_exit=self._batch_loop_exits,
        )
        """The request-level loop: serves singleton / dynamic mode, and continuous mode's fallback batches."""

    @property
    def batching_stats(self) -> BatchingStats | None:
        """Per-dispatch batching metrics and logs (kept by the request-level loop)."""
        return self._batches.batching_stats

    @batching_stats.setter
    def batching_stats(self, stats: BatchingStats | None) -> None:
        self._batches.batching_stats = stats

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
        return len(self.book)

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
        failed = self.fail_all(
            ServiceUnavailableError("The server shut down before this request finished; retry on another replica.")
        )
        # Let the answers reach their handlers before the caller tears the server down.
        await asyncio.sleep(0.05)
        return failed

    def fail_all(self, error: DiffuserveError) -> int:
        """Answer every request not answered yet with `error` (queued ones never run; running ones stop
        at the next step). Returns how many were answered."""
        with self._cond:
            self.scheduler.drain()  # queued requests must never start
            return self.book.fail_all(error)

    def fail_rank(self, message: str) -> None:
        """A rank died or hung: answer everything with an error naming it, turn /health 503, and ask the server
        to exit non-zero (`on_fatal`) so the orchestrator restarts the whole group. Called from any thread."""
        with self._cond:
            if self.state == EngineState.FAILED:
                return
            self.state = EngineState.FAILED
            self.failure = message
            self._cond.notify_all()
        failed = self.fail_all(
            GenerationError(f"{message}; this request was not finished. The server is restarting; retry.")
        )
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

    def _batch_loop_exits(self) -> bool:
        """The request-level loop leaves once the engine stops or fails (caller holds the lock)."""
        return self._stop or self.state == EngineState.FAILED

    def _step_loop_exits(self) -> bool:
        """The step loop leaves once the engine stops; after a rank fault it keeps removing the cancelled rows."""
        return self._stop

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
        pending = self._admit(
            params, asyncio.get_running_loop(), endpoint, timeout_s, priority, ineligible_reason, request_id, preview
        )
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
        return self._admit(
            params, asyncio.get_running_loop(), endpoint, timeout_s, priority, ineligible_reason, request_id, preview
        ).future

    async def admit(self, params: SamplingParams, **submit: Any) -> asyncio.Future[GenerationResult]:
        """`submit` as the routes call it on any engine client (server/engine_client.py): admission errors raise
        here, the answer is the returned future. In this process admission is immediate."""
        return self.submit(params, **submit)

    @contextlib.contextmanager
    def admitting_together(self) -> Iterator[None]:
        """Requests submitted inside arrive as one: no loop dispatches before the last is queued (`generate`'s
        prompts batch as a burst of HTTP requests would, whatever the machine's speed)."""
        with self._cond:
            yield

    def _admit(
        self, params, loop, endpoint, timeout_s, priority, ineligible_reason, request_id, preview=None
    ) -> PendingRequest:
        with self._cond:
            if self.state != EngineState.READY and ineligible_reason != "warmup":
                raise self.not_ready_error()
            limit = self.config.max_queue_size
            if limit and self.scheduler.num_queued >= limit:
                self.metrics.observe_request(endpoint, "rejected", 0.0)
                raise QueueFullError(
                    f"The queue is full ({self.scheduler.num_queued} requests waiting, --max-queue-size {limit}); "
                    "retry later.",
                    retry_after_s=self._retry_after_s(),
                )
            activation = self._activation_bytes(params, ineligible_reason)
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
                activation_bytes=activation,
                row_tokens=self._row_tokens(params),
            )
            future: asyncio.Future[GenerationResult] = loop.create_future()
            # An aborted request's error is delivered to a future nobody awaits any more; mark it seen.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            pending = PendingRequest(request=request, future=future, loop=loop, endpoint=endpoint, preview=preview)
            self.book.admit(pending)
            self.scheduler.add(request)
            self._maybe_prefetch(request)
            self._cond.notify_all()
            return pending

    def _activation_bytes(self, params: SamplingParams, ineligible_reason: str | None) -> int:
        """The request's activation estimate (`diffuserve/activation.py`); a 400 naming the field that makes it too
        big when it alone is over the budget, before it is queued. A few multiplications: cheap under the lock."""
        facts = self._activation_facts
        if facts is None or ineligible_reason == "warmup":
            return 0
        budget = self.config.activation_budget_bytes
        if budget is None:
            return estimate_bytes(facts, params)
        return check_fits(facts, params, budget, source=" (--activation-memory-gib; docs/operations.md)")

    def _maybe_prefetch(self, request: Request) -> None:
        """Dynamic batching, one rank: a request queued behind a running batch has its texts encoded in the
        encode lane meanwhile (`pipelines/text_prefetch.py`), so its own batch starts at the denoise loop. Caller
        holds the lock."""
        if (
            self.mode is not BatchingMode.DYNAMIC
            or not self.scheduler.config.dynamic
            or not self.scheduler.num_running
            or request.ineligible_reason == "warmup"
        ):
            return
        try:
            self.executor.prefetch(request.params, on_done=lambda steps: self.metrics.observe_overlap("encode", steps))
        except Exception:  # an optimisation: the batch encodes the text itself
            logger.warning("could not prefetch the text encode of %s", request.request_id, exc_info=True)

    def abort(self, request_id: str, error: DiffuserveError | None = None) -> None:
        """The client went away: drop a queued request, or cancel a running one at the next step."""
        error = error or RequestCancelledError("The client disconnected; the request was cancelled.")
        with self._cond:
            pending = self.book.get(request_id)
            if pending is None or pending.answered:
                return
            pending.request.cancel_event.set()
            if self.scheduler.abort(request_id) is not None:
                self.metrics.inc_cancelled_before_run()
            self.book.answer_locked(request_id, error=error)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request; None while queued, or once answered/unknown."""
        return self.book.progress(request_id)

    def status(self) -> EngineStatus:
        """The engine's one snapshot of itself (/health, /server_info, the remote status message)."""
        # Asked outside the engine lock: several ranks answer through their store; the pipeline takes its own lock.
        distributed, pipeline = self.executor.describe(), self.pipeline
        described = pipeline.describe() if pipeline is not None else None
        defaults = pipeline.defaults if pipeline is not None else None
        with self._cond:
            book, replicas = self.book, self.executor.replicas
            return engine_status(
                self.state, self.failure, self.scheduler, book, replicas, described, defaults, distributed
            )

    def close_executor(self) -> bool:
        """Stop the executor (its ranks) once the server stopped; True when ranks were held (then the caller
        leaves with `os._exit`: a worker thread may still sit in a collective with a failed peer)."""
        self.executor.shutdown()
        return self.executor.multi_rank

    def requests_using_adapter(self, name: str) -> list[str]:
        """Ids of the queued and running requests whose `lora` names adapter `name`, in either scheduler (running:
        in a request-level batch, or a row of the continuous denoise group). An unload waits until it is empty."""
        with self._cond:
            return [r.request_id for r in self.scheduler.requests_using_adapter(name)]

    def _retry_after_s(self) -> float:
        """A hint for 429s: the queue drains at about one batch per recent batch time."""
        per_batch = self._batches.recent_batch_s or 1.0
        batches = self.scheduler.num_queued / max(1, self.scheduler.config.max_size)
        return max(1.0, round(per_batch * batches, 1))

    @property
    def model(self) -> ModelDescription | None:
        """What the routes need to know about the served model (None until it is loaded)."""
        return self.pipeline.describe_model() if self.pipeline is not None else None

    def not_ready_error(self) -> ServiceUnavailableError:
        return not_ready_error(self.state, self.failure)

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
                self.load_error = exc
            self._ready_event.set()
            if self.on_fatal is not None:
                self.on_fatal(f"the model failed to load: {message}")
            return
        self._ready_event.set()
        self._serving_loop().run()

    def _serving_loop(self) -> BatchLoop | StepLoop:
        """The one loop of this batching mode."""
        if self.mode is not BatchingMode.CONTINUOUS:
            return self._batches
        stats = self.batching_stats
        assert isinstance(self.scheduler, StepScheduler), "continuous batching runs on the step scheduler"
        return StepLoop(
            self.book,
            self.scheduler,
            self.executor,
            fallback=self._batches.run_batch,
            metrics=self.metrics,
            log_steps=bool(stats is not None and stats.log_enabled),
            clock=self.clock,
            should_exit=self._step_loop_exits,
        )

    def _load_and_warm_up(self) -> None:
        started = time.monotonic()
        self.pipeline = self.executor.load()
        capabilities = self.pipeline.capabilities  # what the loaded model can do decides what may merge
        self.scheduler.set_capabilities(
            supports_batching=capabilities.batching,
            supports_continuous=capabilities.continuous,
            packs_mixed_sizes=capabilities.packs_mixed_sizes,
            strength_per_row=capabilities.strength_per_row,
            continuous_key_fields=capabilities.continuous_key_fields,
        )
        self._set_activation_budget(self.pipeline.describe_model())
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
        if self.ready_line:
            logger.info("%s after %.1fs", self.ready_line, time.monotonic() - started)

    def _set_activation_budget(self, model: ModelDescription) -> None:
        """Admission by activation memory (rule 9) and the token budget (rule 4) from the loaded model's facts."""
        with self._cond:
            self._activation_facts = model.activation
            budget = self.config.activation_budget_bytes if model.activation is not None else None
            self.scheduler.activation_budget = budget
            tokens, self._row_tokens = model_token_budget(self.scheduler.config, model, budget)
            self.scheduler.token_budget = tokens.tokens if tokens is not None else None
        if budget is not None:
            logger.info("activation memory budget: %.2f GiB per replica", budget / 1024**3)
        logger.info("token budget: %s", tokens.describe() if tokens else "none (rows only: one size per batch)")

    def _run_warmup(self) -> None:
        """One real generation per warm-up size (the default, then each --warmup-resolutions entry)."""
        assert self.pipeline is not None
        model = self.pipeline.describe_model()
        sizes = [(model.defaults.width, model.defaults.height)]
        sizes += [s for s in self.config.warmup_resolutions if s not in sizes]
        for replica in range(len(self.executor.replicas)):
            for width, height in sizes:
                params = build_sampling_params(
                    model,
                    prompt="warm-up",
                    width=width,
                    height=height,
                    num_inference_steps=self.config.warmup_steps,
                    seed=0,
                    image_inputs=_warmup_images(model, width, height),
                )
                started = time.monotonic()
                outcome = self.executor.execute(
                    replica, BatchMessage(request_ids=("warmup",), params=(params,), compile_warmup=True), NoEvents()
                )
                if outcome.errors:
                    raise RuntimeError(
                        f"warm-up generation at {width}x{height} failed: {outcome.errors['warmup'].message}"
                    )
                where = f" on replica {replica}" if len(self.executor.replicas) > 1 else ""
                logger.info(
                    "warm-up generation (%dx%d, %d steps)%s took %.2fs",
                    width,
                    height,
                    params.num_inference_steps,
                    where,
                    time.monotonic() - started,
                )
