"""`diffuserve serve`: build the engine and app from ServerArgs and run uvicorn with a graceful drain.

SIGTERM/SIGINT do not stop uvicorn at once: /health turns 503, new generation requests get 503,
accepted requests finish and are answered, then the process exits 0. Past --shutdown-timeout-s the
rest are answered with a 503 error first. A second signal cuts the drain short the same way: every
request still in flight is answered with the 503 envelope at once, then the server stops with exit
code 130 (interrupted). A third signal stops uvicorn without waiting for connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
from types import FrameType

import uvicorn

from diffuserve.config.server_args import ServerArgs
from diffuserve.launch.root import build_engine
from diffuserve.server.app import create_app, open_results_store
from diffuserve.server.context import ImageStore, ServerContext

logger = logging.getLogger("diffuserve.server")

INTERRUPTED = 130
"""Exit code when a second signal cut the drain short (128 + SIGINT, as `generate` after Ctrl-C)."""


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
        if self._loop is None:
            # No loop yet (still starting): stop the uvicorn way.
            self.should_exit = True
            return
        if self._drain_started:
            if self._forced:
                self.force_exit = True  # third signal: do not even wait for the answers to go out
                return
            # Second signal: answer everything in flight with the 503 envelope now (never a plain-text
            # 500 from a cancelled handler), then stop as after a drain, exiting 130.
            self._forced = True
            self.exit_code = INTERRUPTED
            logger.warning("signal %s again: answering %d unfinished request(s) with 503 and exiting",
                           sig, self.ctx.engine.num_pending)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(0.0)))
            return
        self._drain_started = True
        self.ctx.draining = True
        self.ctx.engine.begin_drain()
        logger.info("signal %s: draining %d accepted request(s), up to %.0fs", sig, self.ctx.engine.num_pending,
                    self.ctx.args.shutdown_timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self, timeout_s: float | None = None) -> None:
        budget = self.ctx.args.shutdown_timeout_s if timeout_s is None else timeout_s
        failed = await self.ctx.engine.drain(budget)
        if failed:
            logger.warning("shutdown timeout: answered %d unfinished request(s) with an error", failed)
        logger.info("drained; exiting")
        self.should_exit = True


def serve(args: ServerArgs) -> int:
    from diffuserve.launch.follower import serve_other_node
    from diffuserve.launch.ranks import is_serving_process

    if not is_serving_process(args):  # another host's ranks, or a torchrun rank other than 0: no HTTP
        return serve_other_node(args)
    engine, metrics, plan_dict = build_engine(args)
    results = open_results_store(args)
    ctx = ServerContext(args=args, engine=engine, metrics=metrics, results=results,
                        images=ImageStore(results, args.url_store_max_images), plan=plan_dict)
    app = create_app(ctx)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        access_log=args.log_level == "debug",
        loop="uvloop",  # the production stack: uvloop's event loop and httptools' HTTP parser (issue 24)
        http="httptools",
    )
    server = DrainingServer(config, ctx)
    logger.info("serving %r on http://%s:%d", args.public_model_name, args.host, args.port)
    server.run()
    engine.executor.shutdown()
    if hasattr(engine.executor, "topology"):
        # Several ranks: a worker thread may still sit in a collective with a failed peer, and torch's exit
        # handlers would wait on it; the answers are out and the other ranks are stopped, so leave now.
        logging.shutdown()
        os._exit(server.exit_code)
    return server.exit_code
