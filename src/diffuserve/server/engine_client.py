"""What the routes use of the engine (`EngineClient`), and the client of an engine in another process.

`serve --api-process same` (the default) hands the routes the `AsyncEngine` itself. With `--api-process separate`
the engine core (scheduler, loops, pipeline) runs in its own process (launch/engine_process.py), as vLLM's
EngineCore does, and the routes get a `RemoteEngineClient`: the same surface, over the typed messages of
launch/engine_messages.py. HTTP parsing, validation, token counts, PNG/MP4 encoding, base64 and streaming then never
take the GIL from the engine's loops. The client keeps what the routes read synchronously (the `EngineStatus`,
progress, the model's description) from the engine's `Status` / `ModelInfo` messages, pushed when they change, and a
crash of either process is a clean failure: the engine's death answers every open request with a 500, turns /health
503 and makes the server exit 1 (`on_fatal`); the front end's death closes the socket and the engine process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from diffuserve.engine.engine import GenerationResult
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.engine.status import EngineState, EngineStatus, not_ready_error
from diffuserve.errors import DiffuserveError, GenerationError, RequestCancelledError, ServiceUnavailableError
from diffuserve.executor.messages import PreviewSink
from diffuserve.launch import engine_messages as m
from diffuserve.sampling import ModelDescription, SamplingParams

if TYPE_CHECKING:
    from diffuserve.config.server_args import ServerArgs

logger = logging.getLogger("diffuserve.server")

METRICS_TIMEOUT_S = 5.0
"""How long /metrics waits for the engine process's families (past it: the front end's alone)."""


class EngineClient(Protocol):
    """The engine as the routes and the runner see it: `AsyncEngine` in one process, `RemoteEngineClient` across
    two."""

    state: EngineState
    failure: str | None
    on_fatal: Callable[[str], None] | None

    @property
    def model(self) -> ModelDescription | None: ...

    @property
    def num_pending(self) -> int: ...

    def status(self) -> EngineStatus:
        """The engine's one snapshot of itself (/health, /server_info)."""
        ...

    def close_executor(self) -> bool:
        """Stop the ranks this process holds once the server stopped; True when it held ranks."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def stop_before_serving(self) -> bool: ...

    def begin_drain(self) -> None: ...

    async def drain(self, timeout_s: float) -> int: ...

    async def generate(self, params: SamplingParams, **kwargs: Any) -> GenerationResult: ...

    async def admit(self, params: SamplingParams, **kwargs: Any) -> asyncio.Future[GenerationResult]: ...

    def abort(self, request_id: str, error: DiffuserveError | None = None) -> None: ...

    def progress(self, request_id: str) -> tuple[int, int] | None: ...

    def requests_using_adapter(self, name: str) -> list[str]: ...

    def not_ready_error(self) -> ServiceUnavailableError: ...


@dataclasses.dataclass
class _Pending:
    """A request sent to the engine process and not answered yet."""

    admitted: asyncio.Future[None]
    """Resolved by `Admitted`; an admission error (429, 503, the model's 400) is its exception."""
    result: asyncio.Future[GenerationResult]
    """Its answer."""
    preview: PreviewSink | None
    """Where its partial images go (streaming requests)."""


def _mark_seen(future: asyncio.Future) -> None:
    """An error delivered to a future nobody awaits any more is not "never retrieved"."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


class RemoteEngineClient:
    """The front end's side of an engine in another process (`serve --api-process separate`)."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, model_name: str = ""):
        self.proc = proc
        self.conn = conn
        self.model_name = model_name
        self.state = EngineState.LOADING
        self.failure: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.model: ModelDescription | None = None  # type: ignore[misc]
        self._status = EngineStatus(EngineState.LOADING)
        """The engine process's last `EngineStatus` (state and failure: `state` / `failure` here, which also know
        a drain begun here and the engine process's death)."""
        self._progress: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, _Pending] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._draining = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()

    @classmethod
    def launch(cls, args: ServerArgs) -> tuple[RemoteEngineClient, dict[str, Any] | None]:
        """Start the engine process (plan resolved there; the model loads on `start`); raises its set-up error."""
        from diffuserve.launch.engine_process import start_engine_process

        proc, conn, hello = start_engine_process(args)
        if hello.error is not None:
            conn.close()
            proc.wait()
            raise hello.error
        return cls(proc, conn, args.public_model_name), hello.plan

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def num_pending(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        """Start the channel's threads (on the running event loop) and tell the engine to load and warm up."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="diffuserve-front-recv", daemon=True).start()
        self._send(m.Start())

    def stop(self) -> None:
        """Stop the engine process (it answers nothing more) and wait for it; kill it past 10 s."""
        self._stopping = True
        self._send(m.Stop())
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not stop within 10 s; killing it")
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.conn.close()

    def stop_before_serving(self) -> bool:
        """As `AsyncEngine.stop_before_serving`: True (and the engine process is stopped) before it served."""
        if self.state not in (EngineState.LOADING, EngineState.WARMING_UP):
            return False
        self._stopping = True
        self.proc.send_signal(signal.SIGUSR1)  # its handler stops its ranks and exits at once
        return True

    def begin_drain(self) -> None:
        if self.state in (EngineState.READY, EngineState.LOADING, EngineState.WARMING_UP):
            self.state = EngineState.DRAINING
        self._draining = True
        self._send(m.BeginDrain())

    async def drain(self, timeout_s: float) -> int:
        """As `AsyncEngine.drain`, in the engine process; the answers arrive before its reply."""
        self.begin_drain()
        failed = await self._call(lambda call_id: m.Drain(call_id, timeout_s), default=0)
        await asyncio.sleep(0.05)  # let the answers reach their handlers
        return int(failed)

    def not_ready_error(self) -> ServiceUnavailableError:
        return not_ready_error(self.state, self.failure)

    def status(self) -> EngineStatus:
        """The engine process's last pushed `EngineStatus`, with this side's view of its state."""
        return dataclasses.replace(self._status, state=self.state, failure=self.failure)

    def close_executor(self) -> bool:
        """Nothing here: the engine process stops its executor (and its ranks, its children) when it stops."""
        return False

    # ------------------------------------------------------------------------------------------ requests
    async def generate(
        self,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        preview: PreviewSink | None = None,
        **submit: Any,
    ) -> GenerationResult:
        """Submit and await one request. Cancelling the awaiting task aborts the request."""
        request_id = request_id or uuid.uuid4().hex
        pending = self._submit(params, request_id, preview, **submit)
        try:
            return await asyncio.shield(pending.result)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    async def admit(
        self,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        preview: PreviewSink | None = None,
        **submit: Any,
    ) -> asyncio.Future[GenerationResult]:
        """Admit one request (admission errors raise here) and return the future of its answer."""
        request_id = request_id or uuid.uuid4().hex
        pending = self._submit(params, request_id, preview, **submit)
        try:
            await asyncio.shield(pending.admitted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return pending.result

    def _submit(
        self,
        params: SamplingParams,
        request_id: str,
        preview: PreviewSink | None,
        *,
        endpoint: str = "images",
        timeout_s: float | None = None,
        priority: int = 0,
        ineligible_reason: str | None = None,
    ) -> _Pending:
        if self.state != EngineState.READY:
            raise self.not_ready_error()
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), loop.create_future(), preview)
        _mark_seen(pending.admitted)
        _mark_seen(pending.result)
        self._requests[request_id] = pending
        wanted = preview.partial_images if preview is not None else 0
        self._send(m.Submit(request_id, params, endpoint, timeout_s, priority, ineligible_reason, wanted))
        return pending

    def abort(self, request_id: str, error: DiffuserveError | None = None) -> None:
        """The client went away: answer the request here now, and have the engine drop or cancel it."""
        pending = self._requests.pop(request_id, None)
        if pending is None:
            return
        self._send(m.Abort(request_id, error))
        error = error or RequestCancelledError("The client disconnected; the request was cancelled.")
        for future in (pending.admitted, pending.result):
            if not future.done():
                future.set_exception(error)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request, as the engine last reported it."""
        return self._progress.get(request_id) if request_id in self._requests else None

    def requests_using_adapter(self, name: str) -> list[str]:
        """Never asked: runtime adapter changes need the engine in the HTTP process (`ServerArgs.validate` refuses
        `--enable-lora-updates` with `--api-process separate`), so no unload runs beside a remote engine."""
        raise RuntimeError("runtime LoRA changes are refused with --api-process separate")

    async def metric_families(self) -> list[Metric]:
        """The engine process's Prometheus families ([] when it does not answer in time)."""
        return await self._call(m.MetricsQuery, default=[], timeout_s=METRICS_TIMEOUT_S)

    # ------------------------------------------------------------------------------------------ the channel
    def _send(self, message: Any) -> None:
        """Pickle and send now, on the calling thread (the event loop: a request's path has no thread hop; the
        engine process's reader thread drains the socket, so even an upload's bytes go through at copy speed)."""
        with self._send_lock:
            try:
                m.send(self.conn, message)
            except (OSError, EOFError, BrokenPipeError):
                pass  # the engine is gone: the reader sees EOF and reports it

    async def _call(self, make: Callable[[int], Any], *, default: Any, timeout_s: float | None = None) -> Any:
        if self.state == EngineState.FAILED and self.failure and self.proc.poll() is not None:
            return default
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(make(call_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except (asyncio.TimeoutError, DiffuserveError):
            return default
        finally:
            self._calls.pop(call_id, None)

    def _read(self) -> None:
        """The reader thread: each message to the event loop, in order; EOF means the engine process is gone."""
        assert self._loop is not None
        while True:
            try:
                message = m.receive(self.conn)
            except (EOFError, OSError):
                message = None
            try:
                self._loop.call_soon_threadsafe(self._handle, message)
            except RuntimeError:  # the loop is closed: the server is gone already
                return
            if message is None:
                return

    def _handle(self, message: Any) -> None:
        if message is None:
            self._engine_gone()
        elif isinstance(message, m.Status):
            self._on_status(message)
        elif isinstance(message, m.Answer):
            self._on_answer(message)
        elif isinstance(message, m.Admitted):
            pending = self._requests.get(message.request_id)
            if pending is not None and not pending.admitted.done():
                pending.admitted.set_result(None)
        elif isinstance(message, m.PreviewImages):
            pending = self._requests.get(message.request_id)
            if pending is not None and pending.preview is not None:
                pending.preview.deliver(message.index, message.images)
        elif isinstance(message, m.ModelInfo):
            self.model = message.model
        elif isinstance(message, m.Reply):
            future = self._calls.get(message.call_id)
            if future is not None and not future.done():
                future.set_result(message.value)
        elif isinstance(message, m.Fatal):
            self.state, self.failure = EngineState.FAILED, message.message
            if self.on_fatal is not None:
                self.on_fatal(message.message)

    def _on_status(self, message: m.Status) -> None:
        status = message.status
        state = status.state
        if self._draining and state in (EngineState.READY, EngineState.LOADING, EngineState.WARMING_UP):
            state = EngineState.DRAINING  # the engine has not seen our BeginDrain yet
        if self.state != EngineState.FAILED:
            self.state, self.failure = state, status.failure
        self._status = status
        self._progress = message.progress

    def _on_answer(self, answer: m.Answer) -> None:
        pending = self._requests.pop(answer.request_id, None)
        if pending is None:
            return  # aborted here already
        if not answer.admitted:
            pending.admitted.set_exception(answer.error or GenerationError("refused"))
        elif not pending.admitted.done():
            pending.admitted.set_result(None)
        if answer.error is not None:
            pending.result.set_exception(answer.error)
        else:
            pending.result.set_result(answer.result)

    def _engine_gone(self) -> None:
        """EOF from the engine: expected after `stop`; otherwise it crashed — fail everything and exit 1."""
        if self._stopping:
            return
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        message = f"the engine process exited unexpectedly (exit code {code})"
        logger.error("%s; answering %d open request(s) with an error", message, len(self._requests))
        self.state, self.failure = EngineState.FAILED, message
        error = GenerationError(f"{message}; this request was not finished. The server is restarting; retry.")
        for pending in self._requests.values():
            for future in (pending.admitted, pending.result):
                if not future.done():
                    future.set_exception(error)
        self._requests.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        if self.on_fatal is not None:
            self.on_fatal(message)


def merge_families(*groups: Iterable[Metric]) -> list[Metric]:
    """One exposition from several processes' families: samples with the same name and labels add up (counters,
    histograms, gauges such as CPU seconds and memory), except start and creation times (the earliest) and fd
    limits (the largest)."""
    merged: dict[str, Metric] = {}
    samples: dict[str, dict[tuple, Any]] = {}
    for families in groups:
        for family in families:
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                samples[family.name] = {}
            slot = samples[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = slot.get(key)
                if before is not None:
                    if sample.name.endswith(("_created", "start_time_seconds")):
                        value = min(before.value, sample.value)
                    elif sample.name.endswith("max_fds"):
                        value = max(before.value, sample.value)
                    else:
                        value = before.value + sample.value
                    sample = before._replace(value=value)
                slot[key] = sample
    for name, family in merged.items():
        family.samples = list(samples[name].values())
    return list(merged.values())


class _Families:
    """A collector that yields fixed families (what `generate_latest` renders)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


async def render_metrics(engine: Any, metrics: EngineMetrics) -> tuple[bytes, str]:
    """/metrics: this process's collectors, plus the engine process's when the engine runs in one (each process's
    engine gauges refreshed from its `EngineStatus` first: `mirror_into`)."""
    if not isinstance(engine, RemoteEngineClient):
        engine.status().mirror_into(metrics)  # the gauges that mirror the engine's one snapshot
        return metrics.render()
    families = merge_families(metrics.registry.collect(), await engine.metric_families())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry), CONTENT_TYPE_LATEST
