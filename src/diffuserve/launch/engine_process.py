"""The engine-core process of `serve --api-process separate`: the scheduler, the loops and the pipeline, no HTTP.

The front end (server/engine_client.py) starts it with `start_engine_process` and talks to it through the typed
messages of launch/engine_messages.py over one socket pair. Here an asyncio loop owns the real `AsyncEngine`; a
reader thread hands each incoming message to that loop, and a sender thread pickles and sends everything going
out, so neither the engine's worker thread nor its loop ever waits on the socket (a preview's or a result's images
are pickled on the sender thread; PNG and base64 encoding happen in the front end).

Failure is never a hang: when the front end goes away (its end of the socket closes: exit, crash, SIGKILL), this
process stops its ranks and exits at once. SIGINT and SIGTERM are ignored (a Ctrl-C, or a SIGTERM to the whole
control group, reaches both processes): the front end decides how to stop, and drains first; SIGUSR1 (the front
end's "stop before serving") exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.engine.engine import AsyncEngine
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.errors import DiffuserveError, GenerationError
from diffuserve.executor.messages import PreviewSink
from diffuserve.launch import engine_messages as m

logger = logging.getLogger("diffuserve.engine_process")

STATUS_PERIOD_S = 0.25
"""How often the engine process looks for a change the engine's own threads made (progress, a dispatch, turning
ready) to report; a change made on its event loop (a request admitted or answered, a drain) is pushed at once."""


def start_engine_process(args: ServerArgs) -> tuple[subprocess.Popen, Connection, m.Hello]:
    """Spawn the engine process, hand it `args`, and wait for its `Hello` (plan resolved, model not loaded yet).

    A fresh interpreter (`python -m`), not a fork: the front end's threads and event loop stay its own. The child
    inherits the environment (PYTHONPATH, fault injection, CUDA settings) and the log stream."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffuserve.launch.engine_process", str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()  # only the child holds that end now: its exit is our EOF
    conn = Connection(ours.detach())
    m.send(conn, args)
    try:
        hello = m.receive(conn)
    except (EOFError, OSError):
        hello = m.Hello(None, GenerationError(f"the engine process exited during set-up (code {proc.wait()})"))
    return proc, conn, hello


class _Outbox:
    """Messages to the front end, in order. The event loop's thread sends its own (answers, status, replies) at
    once when nothing is queued ahead of them: no thread hop on a request's path. Other threads (the worker's
    previews, a rank fault) only enqueue; the sender thread pickles and sends those."""

    def __init__(self, conn: Connection, on_broken: Callable[[], None]):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._conn = conn
        self._on_broken = on_broken
        self._lock = threading.Lock()
        """Held while a message is sent; `_queued` is read and written under it."""
        self._queued = 0
        self.direct_thread: int | None = None
        """The thread that may send directly (the event loop's), set by `EngineServer.run`."""
        self._thread = threading.Thread(target=self._run, name="diffuserve-engine-send", daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        with self._lock:
            if threading.get_ident() == self.direct_thread and not self._queued:
                self._deliver(message)
                return
            self._queued += 1
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            with self._lock:
                self._queued -= 1
                self._deliver(message)

    def _deliver(self, message: Any) -> None:
        """Send one message (caller holds the lock); an unpicklable payload fails its request, not the channel."""
        try:
            m.send(self._conn, message)
        except (OSError, EOFError, BrokenPipeError):
            self._on_broken()
        except Exception as exc:
            logger.exception("could not send %s to the front end", type(message).__name__)
            if isinstance(message, m.Answer):
                error = GenerationError(f"The result could not be handed to the HTTP front end: {exc}")
                m.send(self._conn, m.Answer(message.request_id, error=error))
            elif isinstance(message, m.ModelInfo):  # the routes cannot serve without it: fail loudly
                m.send(self._conn, m.Fatal(f"the model's description cannot reach the HTTP front end: {exc}"))


def exit_now(reason: str, code: int = 0) -> None:
    """Leave at once (the front end is gone, or SIGTERM): stop this host's ranks, no interpreter shutdown (a
    torch op in the worker thread cannot be interrupted)."""
    import multiprocessing

    logger.warning("engine process: %s; exiting", reason)
    for child in multiprocessing.active_children():
        child.kill()
    logging.shutdown()
    os._exit(code)


class EngineServer:
    """Drives one `AsyncEngine` from the front end's messages, on this process's event loop."""

    def __init__(self, conn: Connection, engine: AsyncEngine, metrics: EngineMetrics):
        self.conn = conn
        self.engine = engine
        self.metrics = metrics
        self.out = _Outbox(conn, lambda: exit_now("the front end closed the channel"))
        self.live: set[str] = set()
        """Requests admitted and not answered yet (their progress goes into `Status`)."""
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model_sent = False
        self._changed: asyncio.Event | None = None
        """Set when a message or an answer changed the engine: the status is looked at (and pushed) at once."""

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._changed = asyncio.Event()
        self.out.direct_thread = threading.get_ident()
        self.engine.on_fatal = lambda message: self.out.put(m.Fatal(message))
        threading.Thread(target=self._read, name="diffuserve-engine-recv", daemon=True).start()
        status = asyncio.ensure_future(self._report_status())
        await self._stopped.wait()
        status.cancel()
        self.engine.stop()
        self.engine.executor.shutdown()
        self.out.close()

    def _read(self) -> None:
        """The reader thread: each message to the loop, in order; EOF (the front end died) ends the process."""
        assert self._loop is not None
        while True:
            try:
                message = m.receive(self.conn)
            except (EOFError, OSError):
                exit_now("the front end went away")
                return
            self._loop.call_soon_threadsafe(self._handle_and_report, message)
            if isinstance(message, m.Stop):
                return

    def _handle_and_report(self, message: Any) -> None:
        self.handle(message)
        self._report_soon()

    def _report_soon(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def handle(self, message: Any) -> None:
        engine = self.engine
        if isinstance(message, m.Submit):
            self._submit(message)
        elif isinstance(message, m.Abort):
            engine.abort(message.request_id, message.error)
        elif isinstance(message, m.Start):
            engine.start()
        elif isinstance(message, m.BeginDrain):
            engine.begin_drain()
        elif isinstance(message, m.Drain):
            asyncio.ensure_future(self._drain(message))
        elif isinstance(message, m.MetricsQuery):
            self.engine.status().mirror_into(self.metrics)  # the gauges that mirror the engine's one snapshot
            self.out.put(m.Reply(message.call_id, list(self.metrics.registry.collect())))
        elif isinstance(message, m.Stop):
            assert self._stopped is not None
            self._stopped.set()

    async def _drain(self, message: m.Drain) -> None:
        failed = await self.engine.drain(message.timeout_s)
        self.out.put(m.Reply(message.call_id, failed))

    def _submit(self, message: m.Submit) -> None:
        request_id = message.request_id
        preview = None
        if message.partial_images:
            preview = PreviewSink(
                message.partial_images, lambda index, images: self.out.put(m.PreviewImages(request_id, index, images))
            )
        try:
            future = self.engine.submit(
                message.params,
                endpoint=message.endpoint,
                timeout_s=message.timeout_s,
                priority=message.priority,
                ineligible_reason=message.ineligible_reason,
                request_id=request_id,
                preview=preview,
            )
        except DiffuserveError as exc:
            self.out.put(m.Answer(request_id, error=exc, admitted=False))
            return
        except Exception as exc:  # a bug in admission: that request fails, loudly
            logger.exception("admission of %s failed", request_id)
            self.out.put(m.Answer(request_id, error=GenerationError(f"{type(exc).__name__}: {exc}"), admitted=False))
            return
        self.live.add(request_id)
        self.out.put(m.Admitted(request_id))
        future.add_done_callback(lambda f: self._answer(request_id, f))

    def _answer(self, request_id: str, future: asyncio.Future) -> None:
        self.live.discard(request_id)
        error = future.exception()
        if error is not None and not isinstance(error, DiffuserveError):
            error = GenerationError(f"{type(error).__name__}: {error}")
        self.out.put(m.Answer(request_id, result=None if error else future.result(), error=error))
        self._report_soon()

    def _status(self) -> m.Status:
        """The engine's one snapshot (`AsyncEngine.status()`, one short hold of its lock) and live progress."""
        engine = self.engine
        progress = {rid: p for rid in self.live if (p := engine.progress(rid)) is not None}
        return m.Status(engine.status(), progress)

    async def _report_status(self) -> None:
        """Push `Status` when it changed: looked at once a message or an answer changed the engine, else every
        `STATUS_PERIOD_S` (not polled under the engine lock); `ModelInfo` goes once, before the state that needs
        it."""
        assert self._changed is not None
        last: m.Status | None = None
        while True:
            self._changed.clear()
            status = self._status()
            if not self._model_sent and self.engine.pipeline is not None:
                self.out.put(m.ModelInfo(self.engine.pipeline.describe_model()))
                self._model_sent = True
            if status != last:
                self.out.put(status)
                last = status
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), STATUS_PERIOD_S)


def _setup(conn: Connection) -> tuple[AsyncEngine, EngineMetrics]:
    """Receive the args, build the engine (plan, ranks) and say `Hello`; a set-up error is sent, then exit 2."""
    from diffuserve.launch.root import build_engine

    args: ServerArgs = m.receive(conn)
    logging.basicConfig(level=args.http.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine, metrics, plan = build_engine(args)
    except Exception as exc:
        error = exc if isinstance(exc, DiffuserveError) else GenerationError(f"{type(exc).__name__}: {exc}")
        logger.error("engine set-up failed: %s", error.message, exc_info=not isinstance(exc, DiffuserveError))
        m.send(conn, m.Hello(None, error))
        conn.close()
        os._exit(2 if isinstance(exc, DiffuserveError) else 1)
    m.send(conn, m.Hello(plan))
    return engine, metrics


def main(fd: int) -> None:
    """The engine process's entry point (`python -m diffuserve.launch.engine_process FD`)."""
    # Signals are the front end's to act on (a Ctrl-C, or systemd's SIGTERM to the whole control group, reaches both
    # processes): it drains, then stops this process. It asks for an immediate exit (a signal before it served)
    # with SIGUSR1.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: exit_now("stopped before serving"))
    conn = Connection(fd)
    engine, metrics = _setup(conn)
    asyncio.run(EngineServer(conn, engine, metrics).run())
    with contextlib.suppress(OSError):
        conn.close()
    if engine.executor.multi_rank:
        logging.shutdown()
        os._exit(0)  # as `serve`: a worker thread may still sit in a collective with a failed peer


if __name__ == "__main__":
    main(int(sys.argv[1]))
