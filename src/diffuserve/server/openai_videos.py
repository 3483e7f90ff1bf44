"""OpenAI-style asynchronous video jobs under /v1/videos (create, list, get, content, remix, cancel, delete).

`POST /v1/videos` validates the body, admits the job to the engine as a normal request (so dynamic
batching merges compatible jobs, and 429/503 are answered at once) and returns the job object while
it is still queued. A background task awaits the engine, encodes the MP4 and records the outcome.
The job's deadline is the engine's (`--request-timeout-s`, or the job's shorter `timeout`); no client
connection is involved, so a finished video is never failed by a client-side timer. Progress is read
from the engine's step counter whenever a job is looked at; reads of a queued or running job carry the
`openai-poll-after-ms` header the SDK's `poll` sleeps for. Image-to-video jobs take `input_reference` (an
upload, or a data: URL) and never merge with other jobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.concurrency import run_in_threadpool

from diffuserve.engine.engine import GenerationResult
from diffuserve.errors import (
    DiffuserveError,
    InvalidRequestError,
    NotFoundError,
    RequestCancelledError,
)
from diffuserve.media.video import encode_mp4, spritesheet, thumbnail
from diffuserve.sampling import SamplingParams
from diffuserve.server import job_routes
from diffuserve.server.common import count_prompt, require_ready, result_timings, served_model, server_context
from diffuserve.server.context import ServerContext
from diffuserve.server.job_routes import error_dict
from diffuserve.server.protocol import error_envelope
from diffuserve.server.video_inputs import create_body
from diffuserve.server.video_jobs import VideoJob, VideoJobStore
from diffuserve.server.video_params import VideoCreateRequest, build_video_params, frames_note

router = APIRouter()


class VideoNotReadyError(DiffuserveError):
    """The job exists but is not in a state that allows the operation (409)."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "video_not_ready"


def _store(ctx: ServerContext) -> VideoJobStore:
    assert ctx.videos is not None, "create_app makes the video job store"
    return ctx.videos


async def _drive_job(
    ctx: ServerContext, job: VideoJob, generation: asyncio.Future[GenerationResult], received: float
) -> None:
    """Await the engine's answer for `job`, encode the MP4 and record the outcome (never raises)."""
    store = _store(ctx)
    try:
        result = await generation
        encode_started = time.monotonic()
        output = result.output
        # A model with sound (LTX-2) gives one waveform per video; the MP4 carries it as its AAC track.
        audio = output.audios[0] if output.audios else None
        content = await run_in_threadpool(encode_mp4, output.videos[0], job.fps, audio, output.audio_sample_rate)
        encode_s = time.monotonic() - encode_started
    except RequestCancelledError as exc:
        store.cancel(job.id, error_dict(exc))
        return
    except DiffuserveError as exc:
        # Answered by the drain's deadline or a second signal: the job reads "stopped", not a bare 503.
        await run_in_threadpool(store.fail, job.id, ctx.jobs.failure(job.id, exc) or error_dict(exc))
        return
    except Exception as exc:  # noqa: BLE001 - a job must always end in a status, whatever went wrong
        store.fail(
            job.id,
            error_envelope(f"Video job failed: {type(exc).__name__}: {exc}", "server_error", None, "generation_failed")[
                "error"
            ],
        )
        return
    # Writing the MP4 (fsync, rename) and its row is blocking I/O: off the event loop.
    await run_in_threadpool(
        store.complete,
        job.id,
        content,
        result_timings(result, encode_s=encode_s, received=received, metrics=ctx.metrics),
    )


INTERRUPTED_ERROR = error_envelope(
    "The server process running this job stopped before it finished (killed or crashed); create the job again.",
    "server_error",
    None,
    "interrupted",
)["error"]
"""The error of a job that was queued or running in a process that died."""


def start_results_sweep(ctx: ServerContext) -> None:
    """Fail the jobs of dead processes now, then sweep retention in the background. After each sweep,
    the jobs running here publish their progress (for polls that reach another replica) and those
    that another replica cancelled or deleted are aborted."""
    results = ctx.results
    assert results is not None

    results.fail_interrupted(INTERRUPTED_ERROR)
    results.watch(lambda job_id: job_routes.stop_if_mine(ctx, _store(ctx), job_id))
    results.start_sweeper(
        ctx.args.http.result_sweep_interval_s, INTERRUPTED_ERROR, lambda: job_routes.sync_live_jobs(ctx, _store(ctx))
    )


def _refresh(ctx: ServerContext, job: VideoJob) -> VideoJob:
    return job_routes.refresh(ctx, _store(ctx), job)


def _get_job(ctx: ServerContext, video_id: str) -> VideoJob:
    job = _store(ctx).get(video_id)
    if job is None:
        raise NotFoundError(
            f"No video job {video_id!r} (unknown id, deleted, or dropped past --max-video-jobs).", param="video_id"
        )
    return _refresh(ctx, job)


POLL_AFTER_HEADER = "openai-poll-after-ms"
POLL_AFTER_MS = 500
"""What job reads tell pollers (the SDK's `poll` sleeps for this header) while a job is queued or running."""
VARIANTS = ("video", "thumbnail", "spritesheet")


def _job_response(job: VideoJob, warnings: list[str] | None = None) -> JSONResponse:
    """A job object, with the poll interval header while it is still queued or running; a new job's answer
    also carries its prompt truncation `warnings` when there are any (the job object itself keeps none)."""
    headers = {} if job.terminal else {POLL_AFTER_HEADER: str(POLL_AFTER_MS)}
    return JSONResponse({**job.to_dict(), **({"warnings": warnings} if warnings else {})}, headers=headers)


async def _prompt_warnings(ctx: ServerContext, params: SamplingParams) -> list[str]:
    """Before queueing: a too-long prompt is a 400 with --reject-truncated-prompts, else a warning and a log line
    (counted in a worker thread on the model's own tokenizer copies)."""
    return (await count_prompt(ctx, {"prompt": params.prompt, "negative_prompt": params.negative_prompt})).warnings


_CREATE_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            media: {"schema": VideoCreateRequest.model_json_schema()}
            for media in ("application/json", "multipart/form-data")
        },
    }
}


async def _start_job(
    ctx: ServerContext,
    params: SamplingParams,
    body: VideoCreateRequest,
    received: float,
    *,
    remixed_from: str | None = None,
) -> VideoJob:
    """Admit `params` to the engine and keep its job (admission errors raise before anything is kept)."""
    conditioned = bool(params.image_inputs)
    job = VideoJob(
        id=f"video_{uuid.uuid4().hex}",
        model=ctx.args.public_model_name,
        prompt=params.prompt,
        width=params.width,
        height=params.height,
        num_frames=params.num_frames,
        fps=params.fps,
        num_inference_steps=params.num_inference_steps,
        seed=params.seed or 0,
        negative_prompt=body.negative_prompt,
        guidance_scale=body.guidance_scale,
        guidance_scale_2=body.guidance_scale_2,
        boundary_ratio=body.boundary_ratio,
        true_cfg_scale=body.true_cfg_scale,
        flow_shift=body.flow_shift,
        generate_audio=params.generate_audio,
        has_input_reference=conditioned,
        remixed_from_video_id=remixed_from,
    )
    # Admission (429 queue full, 503 not ready) raises here, to this client, not into the job. Jobs
    # conditioned on an image never merge with others.
    generation = await ctx.engine.admit(
        params,
        endpoint="videos",
        timeout_s=body.timeout,
        priority=body.priority,
        request_id=job.id,
        ineligible_reason="image_conditioning" if conditioned else None,
    )
    try:
        _store(ctx).add(job)
    except Exception:
        # The store is unavailable (503 naming it): the job is not kept, so it must not run either.
        ctx.engine.abort(job.id, RequestCancelledError(f"The video job {job.id} could not be recorded."))
        raise
    job.runner = asyncio.ensure_future(_drive_job(ctx, job, generation, received))
    ctx.jobs.track(job.id, job.runner, lambda error: _store(ctx).fail(job.id, error))
    return job


@router.post("/v1/videos", tags=["videos"], openapi_extra=_CREATE_SCHEMA)
async def create_video(request: Request) -> JSONResponse:
    """Create a video job; answers at once with the queued job (poll GET /v1/videos/{id})."""
    received = time.monotonic()
    ctx = server_context(request)
    require_ready(ctx)
    body, image = await create_body(request)
    params = build_video_params(body, ctx, image)
    warnings = frames_note(body, params) + await _prompt_warnings(ctx, params)
    return _job_response(await _start_job(ctx, params, body, received), warnings)


class VideoRemixRequest(BaseModel):
    """Body of POST /v1/videos/{id}/remix."""

    model_config = ConfigDict(extra="forbid")
    prompt: StrictStr = Field(min_length=1, description="The new prompt; every other setting is the source job's.")


@router.post(
    "/v1/videos/{video_id}/remix", tags=["videos"], responses={409: {"description": "The source job is not completed."}}
)
async def remix_video(video_id: str, body: VideoRemixRequest, request: Request) -> JSONResponse:
    """A new job with the completed job's settings (size, frames, fps, steps, guidance, negative prompt,
    seed, sound on or off) and a new prompt."""
    received = time.monotonic()
    ctx = server_context(request)
    require_ready(ctx)
    source = _get_job(ctx, video_id)
    if source.status != "completed":
        raise VideoNotReadyError(
            f"Video job {video_id} is {source.status}; only a completed job can be remixed.", param="video_id"
        )
    if source.has_input_reference:
        raise InvalidRequestError(
            f"Video job {video_id} was made from an input image, which is not kept; create a "
            "new job with input_reference instead of remixing.",
            param="video_id",
        )
    fields = VideoCreateRequest(
        prompt=body.prompt,
        size=f"{source.width}x{source.height}",
        num_frames=source.num_frames,
        fps=source.fps,
        num_inference_steps=source.num_inference_steps,
        guidance_scale=source.guidance_scale,
        negative_prompt=source.negative_prompt,
        seed=source.seed,
        guidance_scale_2=source.guidance_scale_2,
        boundary_ratio=source.boundary_ratio,
        true_cfg_scale=source.true_cfg_scale,
        flow_shift=source.flow_shift,
        generate_audio=source.generate_audio,
    )
    params = build_video_params(fields, ctx)
    warnings = await _prompt_warnings(ctx, params)
    return _job_response(await _start_job(ctx, params, fields, received, remixed_from=video_id), warnings)


@router.get("/v1/videos", tags=["videos"])
async def list_videos(
    request: Request,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = Query(default=None),
    order: Literal["asc", "desc"] = Query(default="desc"),
) -> dict[str, Any]:
    """Kept jobs, newest first (`order=asc`: oldest first); `after` is the last id of the previous page."""
    ctx = server_context(request)
    model = served_model(ctx)
    if model is not None and model.output_kind != "video":  # a shared --output-dir: not this server's jobs
        return {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    try:
        page, has_more = await run_in_threadpool(
            _store(ctx).list, limit=limit, after=after, newest_first=order == "desc"
        )
    except KeyError:
        raise InvalidRequestError(f"after={after!r} is not a kept video job id.", param="after") from None
    return job_routes.list_page([_refresh(ctx, job).to_dict() for job in page], has_more)


@router.get("/v1/videos/{video_id}", tags=["videos"])
async def get_video(video_id: str, request: Request) -> JSONResponse:
    # A store read (a PostgreSQL round trip with --results-db) off the event loop, so polls overlap.
    return _job_response(await run_in_threadpool(_get_job, server_context(request), video_id))


@router.get(
    "/v1/videos/{video_id}/content",
    tags=["videos"],
    response_class=Response,
    responses={
        200: {
            "content": {"video/mp4": {}, "image/webp": {}, "image/jpeg": {}},
            "description": "variant=video: the MP4; thumbnail: its first frame (WebP); spritesheet: a grid of "
            "evenly spaced frames (JPEG).",
        },
        409: {"description": "The job is not completed (queued, in progress, failed or cancelled)."},
    },
)
async def video_content(video_id: str, request: Request, variant: str = Query(default="video")) -> Response:
    ctx = server_context(request)
    if variant not in VARIANTS:
        raise InvalidRequestError(
            f"variant={variant!r} is not served; choose one of {list(VARIANTS)}.", param="variant"
        )
    job = _get_job(ctx, video_id)
    if variant == "video" and job.status == "completed" and ctx.args.store.media_presign_s > 0:
        url = await run_in_threadpool(_store(ctx).presign, job, ctx.args.store.media_presign_s)
        if url is not None:  # --media-store with --media-presign-s: the client fetches from the bucket
            return RedirectResponse(url, status_code=307)
    content = await run_in_threadpool(_store(ctx).content, job) if job.status == "completed" else None
    if content is None:
        hint = "poll GET /v1/videos/{id} until status is completed" if not job.terminal else "it has no video"
        raise VideoNotReadyError(f"Video job {video_id} is {job.status}; {hint}.", param="video_id")
    if variant == "thumbnail":
        return Response(content=await run_in_threadpool(thumbnail, content), media_type="image/webp")
    if variant == "spritesheet":
        return Response(content=await run_in_threadpool(spritesheet, content), media_type="image/jpeg")
    return Response(
        content=content, media_type="video/mp4", headers={"Content-Disposition": f'inline; filename="{job.id}.mp4"'}
    )


@router.post(
    "/v1/videos/{video_id}/cancel",
    tags=["videos"],
    responses={409: {"description": "The job already completed or failed."}},
)
async def cancel_video(video_id: str, request: Request) -> dict[str, Any]:
    """Queued: removed, it never runs. Running: stopped at the next denoising step. Both end cancelled."""
    ctx = server_context(request)
    job = _get_job(ctx, video_id)
    if job.terminal and job.status != "cancelled":
        # Not "not ready": the job is finished and there is nothing left to cancel.
        raise VideoNotReadyError(
            f"Video job {video_id} already {job.status}: there is nothing to cancel; DELETE it to remove it.",
            param="video_id",
            code="video_already_finished",
        )
    job_routes.cancel(ctx, _store(ctx), job, f"POST /v1/videos/{video_id}/cancel")
    return _get_job(ctx, video_id).to_dict()


@router.delete("/v1/videos/{video_id}", tags=["videos"])
async def delete_video(video_id: str, request: Request) -> dict[str, Any]:
    """Remove a job and its MP4; a queued or running job is cancelled first."""
    ctx = server_context(request)
    job = _get_job(ctx, video_id)
    job_routes.cancel(ctx, _store(ctx), job, f"DELETE /v1/videos/{video_id}")
    _store(ctx).remove(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}
