"""The FastAPI app: routes, the one error -> HTTP mapping, middleware and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffuserve import __version__
from diffuserve.errors import ConfigError, DiffuserveError
from diffuserve.server import (
    api_docs,
    health,
    models_routes,
    openai_images,
    openai_meshes,
    openai_videos,
    playground,
)
from diffuserve.server.common import served_model
from diffuserve.server.context import ServerContext
from diffuserve.server.mesh_jobs import MeshJobStore
from diffuserve.server.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, TrailingSlashMiddleware
from diffuserve.server.protocol import ErrorEnvelope, error_envelope
from diffuserve.server.result_cache import build_result_cache
from diffuserve.server.video_jobs import VideoJobStore
from diffuserve.storage import ResultStore, RetentionPolicy
from diffuserve.storage.open import open_results

logger = logging.getLogger("diffuserve.server")


def _error_response(
    status: int, message: str, error_type: str, param: str | None, code: str | None, retry_after_s: float | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
    return JSONResponse(error_envelope(message, error_type, param, code), status_code=status, headers=headers)


def _param_of(loc: tuple) -> str:
    """('body', 'size') -> 'size'; ('body',) -> 'body'; ('query', 'index') -> 'index'."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) if parts else (str(loc[0]) if loc else "body")


def install_error_handlers(app: FastAPI, count: Callable[[int, str], None] | None = None) -> None:
    """Map every error to its envelope; `count(status, code)` records each answer for /metrics."""

    def respond(
        status: int,
        message: str,
        error_type: str,
        param: str | None,
        code: str | None,
        retry_after_s: float | None = None,
    ) -> JSONResponse:
        if count is not None:
            count(status, code or "none")
        return _error_response(status, message, error_type, param, code, retry_after_s)

    @app.exception_handler(DiffuserveError)
    async def _diffuserve_error(_: Request, exc: DiffuserveError) -> JSONResponse:
        return respond(
            exc.http_status, exc.message, exc.error_type, exc.param, exc.code, getattr(exc, "retry_after_s", None)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        param = _param_of(tuple(first.get("loc", ("body",))))
        if first.get("type") == "extra_forbidden":
            message = f"Unknown field {param!r}; remove it (see the API reference for accepted fields)."
        elif first.get("type") in ("json_invalid", "model_attributes_type", "dict_type") or param == "body":
            param = "body"
            message = "The request body must be a JSON object (Content-Type: application/json). " + str(
                first.get("msg", "")
            )
        else:
            message = f"Invalid value for {param!r}: {first.get('msg', 'invalid')}."
        return respond(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return respond(
                404, f"No route {request.method} {request.url.path}.", "invalid_request_error", None, "not_found"
            )
        if exc.status_code == 405:
            return respond(
                405,
                f"Method {request.method} is not allowed on {request.url.path}.",
                "invalid_request_error",
                None,
                "method_not_allowed",
            )
        return respond(exc.status_code, str(exc.detail), "invalid_request_error", None, None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return respond(500, f"Internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorEnvelope, "description": description}
    for status, description in {
        400: "Invalid request; `param` names the field.",
        401: "Missing or invalid API key.",
        404: "Unknown route, model or image id.",
        405: "Method not allowed.",
        413: "Request body over --max-request-bytes.",
        429: "Queue full (--max-queue-size); see Retry-After.",
        500: "Generation failed (every request of the failing batch gets this).",
        503: "Not ready yet, or shutting down.",
        504: "The request passed its deadline.",
    }.items()
}
"""Every error the API can answer, documented in /openapi.json with the OpenAI envelope."""


def open_results_store(args) -> ResultStore:
    """The results store under --output-dir, with the retention flags (a clear start-up error if unusable)."""
    folder = args.resolved_output_dir()
    policy = RetentionPolicy(
        ttl_s=args.http.result_ttl_s, max_bytes=args.http.max_output_bytes, heartbeat_stale_s=args.store.owner_timeout_s
    )
    try:
        return open_results(
            folder,
            policy,
            results_db=args.store.results_db,
            media_store=args.store.media_store,
            s3_endpoint_url=args.store.s3_endpoint_url,
            create_bucket=args.store.media_store_create_bucket,
        )
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(
            f"--output-dir: cannot keep results in {str(folder)!r} ({exc}); give a writable folder "
            "on a local filesystem."
        ) from exc


async def _prepare_prompt_counter(ctx: ServerContext) -> None:
    """Build the front end's prompt counter (tokenizers loaded from the folders the model's description names) in a
    worker thread as soon as the engine has described the model, so no request loads tokenizers on the event loop;
    the engine's warm-up runs meanwhile, and requests wait for it (503) anyway."""
    while ctx.engine.model is None:
        await asyncio.sleep(0.25)
    try:
        await run_in_threadpool(served_model, ctx)
    except Exception:  # noqa: BLE001 - the first request builds it again and reports the error
        logging.getLogger("diffuserve.server").exception("building the prompt counter failed")


def create_app(ctx: ServerContext) -> FastAPI:
    """Build the app around an engine that is started by the lifespan (load and warm-up run in its thread)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        counter = asyncio.create_task(_prepare_prompt_counter(ctx))
        openai_videos.start_results_sweep(ctx)
        openai_meshes.start_mesh_sync(ctx)
        try:
            yield
        finally:
            counter.cancel()
            assert ctx.results is not None
            ctx.results.stop_sweeper()
            ctx.engine.stop()

    # redirect_slashes off: TrailingSlashMiddleware serves `/route/` as `/route` instead of a 307.
    app = FastAPI(
        title="diffuserve",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible image generation with dynamic batching.",
        responses=ERROR_RESPONSES,
        redirect_slashes=False,
        docs_url=None,
        redoc_url=None,
    )  # /docs: api_docs, offline; ReDoc breaks under the CSP
    if ctx.results is None:
        ctx.results = open_results_store(ctx.args)
    if ctx.videos is None:
        ctx.videos = VideoJobStore(ctx.results, ctx.args.http.max_video_jobs)
    if ctx.meshes is None:
        ctx.meshes = MeshJobStore(ctx.results, ctx.args.http.max_mesh_jobs)
    if ctx.result_cache is None:
        ctx.result_cache = build_result_cache(ctx.args, ctx.results, ctx.metrics.registry, ctx.plan)
    app.state.ctx = ctx
    count = ctx.metrics.observe_error
    install_error_handlers(app, count)
    app.include_router(health.router)
    app.include_router(models_routes.router)
    app.include_router(openai_images.router)
    app.include_router(openai_videos.router)
    app.include_router(openai_meshes.router)
    app.include_router(playground.router)
    app.include_router(api_docs.router)
    # Outermost first: the body cap runs before auth so an oversized anonymous upload is never read.
    api_key = ctx.args.resolved_api_key()
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, count=count)
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=ctx.args.limits.max_request_bytes,
        path_caps={"/v1/images/edits": (ctx.args.limits.max_upload_bytes, "--max-upload-bytes")},
        count=count,
    )
    # Outermost: the other middleware and the router see the path without its trailing slash.
    app.add_middleware(TrailingSlashMiddleware)
    return app
