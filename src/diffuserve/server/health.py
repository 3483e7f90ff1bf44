"""Probes and observability: /liveness, /health, /metrics, /server_info."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from diffuserve import __version__
from diffuserve.server.common import server_context
from diffuserve.server.engine_client import render_metrics

router = APIRouter()


# HEAD too (probes and uptime checkers use it); kept out of the schema so the operation ids stay unique.
@router.head("/liveness", include_in_schema=False)
@router.get("/liveness", tags=["health"])
async def liveness() -> dict[str, str]:
    """200 as soon as the process serves HTTP."""
    return {"status": "alive"}


@router.head("/health", include_in_schema=False)
@router.get("/health", tags=["health"])
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded and the warm-up generation ran; 503 before, and while draining."""
    ctx = server_context(request)
    status = ctx.engine.status()
    ready = status.ready and not ctx.draining
    body = {"status": "ready" if ready else ("draining" if ctx.draining else status.state.value)}
    if status.failure:
        body["error"] = status.failure
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    tags=["health"],
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format."}},
)
async def metrics(request: Request) -> Response:
    ctx = server_context(request)
    payload, content_type = await render_metrics(ctx.engine, ctx.metrics)
    return Response(content=payload, media_type=content_type)


@router.get("/server_info", tags=["models"])
async def server_info(request: Request) -> dict:
    ctx = server_context(request)
    args = ctx.args
    status = ctx.engine.status()
    return {
        "version": __version__,
        "model": args.public_model_name,
        "served_model_name": args.public_model_name,
        "model_id": args.model.model_id,
        "model_path": args.model.model_path,
        "state": status.state.value,
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "pipeline": status.pipeline,
        "defaults": dataclasses.asdict(status.defaults) if status.defaults is not None else None,
        "deployment_plan": ctx.plan,
        "results_store": ctx.results.where,
        "batching": {
            "mode": args.batching.mode,
            "max_size": args.batching.max_size,
            "delay_ms": args.batching.delay_ms,
            "config": args.batching.rules_path,
        },
        "queue": {"queued": status.num_queued, "max_queue_size": args.engine.max_queue_size},
        "replicas": [dataclasses.asdict(replica) for replica in status.replicas],
        "distributed": status.distributed,
        "limits": {
            "request_timeout_s": args.engine.request_timeout_s,
            "max_request_bytes": args.limits.max_request_bytes,
            "max_inference_steps": args.http.max_inference_steps,
            "max_image_side": args.http.max_image_side,
            "auth_required": args.resolved_api_key() is not None,
        },
    }
