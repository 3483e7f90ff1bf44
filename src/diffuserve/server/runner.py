"""`diffuserve serve`: build the engine and app from ServerArgs and run uvicorn with a graceful drain.

SIGTERM/SIGINT do not stop uvicorn at once: /health turns 503, new generation requests get 503,
accepted requests finish and are answered, video and mesh jobs finish their files and `completed` rows,
then the process exits 0. Past --shutdown-timeout-s the rest are answered with a 503 error first (and
unfinished jobs end `failed`, code `shutdown`). A second signal cuts the drain short the same way: every
request still in flight is answered with the 503 envelope at once, then the server stops with exit
code 130 (interrupted). A third signal stops uvicorn without waiting for connections.

Before the server has served (imports, plan, model load, warm-up) there is nothing to drain: a signal
stops the process at once (`stop_before_serving`), exit 0 for SIGTERM and 130 for SIGINT, and the log
never says "ready" or "drained". The port is bound before any of that (after the flags' own checks, so a bad
flag is named as the flag), so a port in use is a one-line configuration error (exit 2), not a model load followed
by uvicorn's exit 3.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import ConfigError

if TYPE_CHECKING:
    from diffuserve.engine.metrics import EngineMetrics
    from diffuserve.server.context import ServerContext
    from diffuserve.server.engine_client import EngineClient

logger = logging.getLogger("diffuserve.server")

INTERRUPTED = 130
"""Exit code when a second signal cut the drain short, or SIGINT stopped the start-up (128 + SIGINT, as
`generate` after Ctrl-C)."""

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

KEEP_ALIVE_S = 75
"""Seconds an idle client connection is kept open. Longer than the idle expiry of the clients and proxies in front
(httpx and the openai SDK: 5 s, nginx and AWS load balancers: 60 s), so the client always closes an idle connection
first. With uvicorn's 5 s, equal to httpx's, a client could send a request on a connection the server was closing
at that moment, and get "Server disconnected without sending a response" (the soak lost an edit that way)."""


def stop_before_serving(sig: int, phase: str) -> None:
    """Exit now, from a signal handler: the server has served nothing, so there is nothing to drain or save.

    os._exit, not sys.exit: the model may be loading or warming up in another thread, inside a torch op that
    cannot be interrupted (a 2048x2048 warm-up step takes seconds); interpreter shutdown around that thread
    aborts ("terminate called without an active exception", SIGABRT), and a KeyboardInterrupt raised inside
    an extension's import prints a pybind11 traceback. This host's rank processes (our children, which load
    their share too) are stopped first. The results store is SQLite (crash-safe) and holds nothing of ours yet.
    """
    import multiprocessing

    code = INTERRUPTED if sig == signal.SIGINT else 0
    logger.warning("%s during start-up (%s): stopping before serving, exit %d", signal.Signals(sig).name, phase, code)
    for child in multiprocessing.active_children():
        child.kill()
    logging.shutdown()
    os._exit(code)


def install_startup_signal_handlers() -> Callable[[], None]:
    """From process start until uvicorn takes the signals over: SIGTERM / SIGINT stop at once (see
    `stop_before_serving`). The CLI calls this before the heavy imports (torch) of `serve`. Returns what puts
    the previous handlers back (for callers that go on after `serve` returns, such as tests)."""
    previous = {sig: signal.signal(sig, lambda s, _frame: stop_before_serving(s, "starting")) for sig in _STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def bind_port(host: str, port: int) -> socket.socket:
    """Bind the HTTP port before anything loads: one clear line when it is taken (uvicorn would first load the
    model, then log the OSError and exit 3)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebinding after a restart works
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use (another server?); stop it or choose another with --port.",
                param="port",
            ) from exc
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); check --host and --port.", param="port"
        ) from exc
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the engine before stopping."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx
        self._drain_started = False
        self._forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0
        ctx.engine.on_fatal = self._fatal

    async def startup(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def _fatal(self, message: str) -> None:
        """The model cannot load, or a rank failed: exit 1 so the orchestrator restarts us, not a stuck 503."""
        logger.error("exiting: %s", message)
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        engine = self.ctx.engine
        if not self._drain_started:
            phase = engine.state.value
            if self._loop is None or engine.stop_before_serving():  # still loading or warming up
                stop_before_serving(sig, phase)
        if self._drain_started:
            if self._forced:
                self.force_exit = True  # third signal: do not even wait for the answers to go out
                return
            # Second signal: answer everything in flight with the 503 envelope now (never a plain-text
            # 500 from a cancelled handler), then stop as after a drain, exiting 130.
            self._forced = True
            self.exit_code = INTERRUPTED
            name = signal.Signals(sig).name
            self.ctx.jobs.stop_reason = f"a second {name} cut the drain short"
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(0.0, again=name)))
            return
        self._drain_started = True
        self.ctx.draining = True
        engine.begin_drain()
        timeout_s = self.ctx.args.http.shutdown_timeout_s
        self.ctx.jobs.stop_reason = f"its deadline, --shutdown-timeout-s {timeout_s:g}, passed"
        logger.info(
            "%s: draining %d accepted request(s) and %d job(s), up to %.0fs",
            signal.Signals(sig).name,
            engine.num_pending,
            len(self.ctx.jobs),
            timeout_s,
        )
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self, timeout_s: float | None = None, again: str | None = None) -> None:
        """Drain, then stop uvicorn. `again`: the second signal's name; it cut the drain short, and the log says
        so once (how many it answered with 503), with no "drained" line.

        The drain is the engine's (every accepted request generated and answered), then the job drivers' (each
        video or mesh job encoded, written and recorded `completed`), both within the one budget; the jobs still
        unfinished at its end are recorded as stopped by the drain (server/job_drain.py)."""
        budget = self.ctx.args.http.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        failed = await self.ctx.engine.drain(budget)
        await self.ctx.jobs.wait(deadline)
        if again is None and self._forced:
            return  # a second signal cut this drain short; its own call logs and exits
        stopped = await self.ctx.jobs.stop_rest()
        jobs = f", {stopped} job(s) recorded as stopped" if stopped else ""
        if again is not None:
            logger.warning(
                "%s again: answered %d unfinished request(s) with 503%s; exiting %d", again, failed, jobs, INTERRUPTED
            )
        else:
            if failed or stopped:
                logger.warning("shutdown timeout: answered %d unfinished request(s) with an error%s", failed, jobs)
            logger.info("drained; exiting")
        self.should_exit = True


def _build_engine(args: ServerArgs) -> tuple[EngineClient, EngineMetrics, dict | None]:
    """The engine in this process (--api-process same), or the client of the engine process (separate): then this
    process's metrics hold what the front end observes, merged with the engine's at /metrics."""
    if args.http.api_process == "separate":
        from diffuserve.engine.metrics import EngineMetrics
        from diffuserve.server.engine_client import RemoteEngineClient

        client, plan = RemoteEngineClient.launch(args)
        logger.info("engine core in process %d; HTTP front end in process %d", client.proc.pid, os.getpid())
        return client, EngineMetrics(), plan
    from diffuserve.launch.root import build_engine

    return build_engine(args)


MALLOC_ARENAS = 2
"""glibc malloc arenas a serving process keeps (`mallopt(M_ARENA_MAX)`), unless MALLOC_ARENA_MAX is set."""


def limit_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas before the serving threads start. glibc gives each thread that contends for the heap
    its own arena (up to 8 per core), and memory freed into an arena stays there for that arena's next user: with the
    server's pools of short-lived worker threads, RSS climbed to a plateau ~12 % above its warm-up level in a
    15-minute soak (the mesh server; `benchmarks/soak.py`) and stayed within 2 % with two arenas. An operator's own
    MALLOC_ARENA_MAX wins (glibc reads it at start-up); other C libraries have no such knob and are left alone.
    True when the cap was set here."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-8, MALLOC_ARENAS) == 1  # M_ARENA_MAX (glibc's malloc.h); 1: done
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False


def serve(args: ServerArgs) -> int:
    from diffuserve.launch.follower import serve_other_node
    from diffuserve.launch.ranks import is_serving_process

    if not is_serving_process(args):  # another host's ranks, or a torchrun rank other than 0: no HTTP
        return serve_other_node(args)
    args.validate()  # a bad flag is named as the flag, even when the port is taken too
    limit_malloc_arenas()
    sock = bind_port(args.http.host, args.http.port)
    from diffuserve.server.app import create_app, open_results_store
    from diffuserve.server.context import ImageStore, ServerContext

    engine, metrics, plan_dict = _build_engine(args)
    results = open_results_store(args)
    logger.info("results store: %s", results.describe())
    ctx = ServerContext(
        args=args,
        engine=engine,
        metrics=metrics,
        results=results,
        images=ImageStore(results, args.http.url_store_max_images),
        plan=plan_dict,
    )
    app = create_app(ctx)
    config = uvicorn.Config(
        app,
        host=args.http.host,
        port=args.http.port,
        log_level=args.http.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=args.http.log_level == "debug",
        loop="uvloop",  # the production stack: uvloop's event loop and httptools' HTTP parser (issue 24)
        http="httptools",
    )
    server = DrainingServer(config, ctx)
    logger.info("serving %r on http://%s:%d", args.public_model_name, args.http.host, args.http.port)
    server.run(sockets=[sock])
    if engine.close_executor():
        # Several ranks: a worker thread may still sit in a collective with a failed peer, and torch's exit
        # handlers would wait on it; the answers are out and the other ranks are stopped, so leave now.
        logging.shutdown()
        os._exit(server.exit_code)
    return server.exit_code
