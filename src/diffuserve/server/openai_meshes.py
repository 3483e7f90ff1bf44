"""Asynchronous image-to-3D mesh jobs under /v1/meshes, SGLang-Diffusion's API (create, list, get, content,
cancel, delete), for mesh families (Hunyuan3D-2).

`POST /v1/meshes` takes one image (multipart `image`, or JSON `input_image` as a data: URL; http(s) URLs only with
--allow-remote-urls, fetched safely by server/media_sources.py) and `model`, `seed`, `num_inference_steps`,
`guidance_scale`, `output_format` (glb | obj), `octree_resolution`; `prompt` is accepted and ignored, as SGLang
does. The job is admitted to the engine as a normal request, so dynamic batching merges jobs with equal steps,
guidance and octree settings into one DiT batch; a rejected create keeps no job. The GLB asked for is a real GLB
(SGLang writes OBJ when texturing is off). With a shared results store, a cancel or delete sent to any replica stops
the job where it runs (`start_mesh_sync`, as video jobs do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from diffuserve.errors import DiffuserveError, InvalidRequestError, NotFoundError, RequestCancelledError
from diffuserve.family_spec.request_rules import validate_request
from diffuserve.media.images import decode_image
from diffuserve.media.meshes import MESH_FORMATS, encode_mesh
from diffuserve.sampling import SamplingParams, build_sampling_params
from diffuserve.server import job_routes
from diffuserve.server.common import check_request_limits, require_ready, result_timings, served_model, server_context
from diffuserve.server.context import ServerContext
from diffuserve.server.job_routes import error_dict
from diffuserve.server.media_sources import FetchPolicy, load_image_source
from diffuserve.server.mesh_jobs import MeshJob, MeshJobStore
from diffuserve.server.protocol import MAX_SEED, coerce_form_fields, error_envelope

router = APIRouter()
IMAGE_FIELDS = ("image", "input_image")


class MeshNotReadyError(DiffuserveError):
    http_status = 409
    error_type = "invalid_request_error"
    code = "mesh_not_ready"


class MeshCreateRequest(BaseModel):
    """Fields of POST /v1/meshes besides the image."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(default=None, description="Served model name (optional).")
    prompt: StrictStr | None = Field(default=None, description="Accepted and ignored (the image conditions the shape).")
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED, description="Random seed.")
    num_inference_steps: StrictInt | None = Field(default=None, ge=1, description="DiT steps.")
    guidance_scale: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=100, description="Guidance scale.")
    output_format: Literal["glb", "obj"] = Field(default="glb", description="glb (binary glTF) or obj.")
    octree_resolution: StrictInt | None = Field(default=None, ge=16, description="Grid cells per side of the volume.")


def _store(ctx: ServerContext) -> MeshJobStore:
    assert ctx.meshes is not None, "create_app makes the mesh job store"
    return ctx.meshes


def _jobs(request: Request) -> MeshJobStore:
    return _store(server_context(request))


def start_mesh_sync(ctx: ServerContext) -> None:
    """Share this process' mesh jobs with the other replicas of its results store: after each sweep publish
    their progress (for polls that reach another replica) and stop those another replica cancelled or deleted;
    on a PostgreSQL notification stop such a job at once (at its next DiT step or decode chunk)."""
    jobs = _store(ctx)
    assert ctx.results is not None
    ctx.results.watch(lambda job_id: job_routes.stop_if_mine(ctx, jobs, job_id))
    ctx.results.add_sweep_hook(lambda: job_routes.sync_live_jobs(ctx, jobs))


async def _create_body(request: Request) -> tuple[MeshCreateRequest, bytes]:
    """The fields (multipart or JSON) and the one image's bytes; errors name the field."""
    ctx = server_context(request)
    images: list[tuple[str, Any]] = []
    if request.headers.get("content-type", "").startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form()
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if key in IMAGE_FIELDS:
                images.append((key, value))
            elif not isinstance(value, str):
                raise InvalidRequestError(f"{key}: only `image` may be a file.", param=key)
            else:
                fields[key] = value
        data: Any = coerce_form_fields(MeshCreateRequest, fields)
    else:
        try:
            data = await request.json()
        except ValueError:
            raise InvalidRequestError(
                "The body must be a JSON object or multipart form fields.", param="body"
            ) from None
        if not isinstance(data, dict):
            raise InvalidRequestError("The body must be a JSON object.", param="body")
        images = [(k, data.pop(k)) for k in IMAGE_FIELDS if k in data]
    try:
        body = MeshCreateRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc
    if not images:
        raise InvalidRequestError(
            "An image is required: upload it as `image` (multipart) or send `input_image` as a data: URL.",
            param="image",
        )
    if len(images) > 1:
        raise InvalidRequestError(
            f"One image per mesh job; got {len(images)}. Create one job per image.", param="image"
        )
    field, value = images[0]
    image = await load_image_source(value, field, FetchPolicy.from_limits(ctx.args.limits))
    await run_in_threadpool(decode_image, image, max_pixels=ctx.args.http.max_image_side**2, param=field)
    return body, image


def build_mesh_params(body: MeshCreateRequest, ctx: ServerContext, image: bytes) -> SamplingParams:
    model = served_model(ctx)
    assert model is not None
    if model.output_kind != "mesh":
        raise InvalidRequestError(
            f"The served model {ctx.args.public_model_name!r} makes {model.outputs}, not meshes.",
            param="model",
            code="model_not_supported",
        )
    steps = body.num_inference_steps or model.defaults.num_inference_steps
    check_request_limits(ctx, model=body.model, texts={"prompt": body.prompt}, width=1, height=1, steps=steps)
    params = build_sampling_params(
        model,
        prompt=body.prompt or "",
        num_inference_steps=steps,
        guidance_scale=None if body.guidance_scale is None else float(body.guidance_scale),
        seed=body.seed,
        output_format=body.output_format,
        image_inputs=(image,),
    )
    if body.octree_resolution is not None and body.octree_resolution > ctx.args.http.max_octree_resolution:
        raise InvalidRequestError(
            f"octree_resolution={body.octree_resolution} exceeds this server's limit of "
            f"{ctx.args.http.max_octree_resolution} (--max-octree-resolution).",
            param="octree_resolution",
        )
    # The value the job runs with (the checkpoint's default when unset), so the job reports it, not 0.
    params = dataclasses.replace(params, octree_resolution=body.octree_resolution or model.defaults.octree_resolution)
    if model.rules is not None:
        validate_request(params, model.rules)
    return params


async def _drive(ctx: ServerContext, jobs: MeshJobStore, job: MeshJob, generation: Any, received: float) -> None:
    """Await the engine, encode the mesh and record the outcome (never raises)."""
    try:
        result = await generation
        mesh = result.output.meshes[0]
        if mesh.error:
            raise InvalidRequestError(mesh.error, param="image", code="no_surface")
        started = time.monotonic()
        content = await run_in_threadpool(encode_mesh, mesh.vertices, mesh.faces, job.output_format)
        timings = result_timings(result, encode_s=time.monotonic() - started, received=received)
    except RequestCancelledError as exc:
        jobs.finish(job.id, "cancelled", error=error_dict(exc))
        return
    except DiffuserveError as exc:
        # Answered by the drain's deadline or a second signal: the job reads "stopped", not a bare 503.
        error = ctx.jobs.failure(job.id, exc) or error_dict(exc)
        await run_in_threadpool(lambda: jobs.finish(job.id, "failed", error=error))
        return
    except Exception as exc:  # noqa: BLE001 - a job always ends in a status
        jobs.finish(
            job.id,
            "failed",
            error=error_envelope(
                f"Mesh job failed: {type(exc).__name__}: {exc}", "server_error", None, "generation_failed"
            )["error"],
        )
        return
    await run_in_threadpool(
        lambda: jobs.finish(
            job.id,
            "completed",
            content=content,
            timings=timings,
            num_vertices=len(mesh.vertices),
            num_faces=len(mesh.faces),
        )
    )


@router.post("/v1/meshes", tags=["meshes"])
async def create_mesh(request: Request) -> dict[str, Any]:
    """Create a mesh job; answers at once with the queued job (poll GET /v1/meshes/{id})."""
    received = time.monotonic()
    ctx = server_context(request)
    require_ready(ctx)
    body, image = await _create_body(request)
    params = build_mesh_params(body, ctx, image)
    jobs = _jobs(request)
    jobs.check_room()  # 429 before any work; no await until the job is kept, so the check holds
    job = MeshJob(
        id=f"mesh_{uuid.uuid4().hex}",
        model=ctx.args.public_model_name,
        seed=params.seed or 0,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        octree_resolution=params.octree_resolution,
        output_format=params.output_format,
        prompt=params.prompt,
    )
    # Admission errors (429, 503) raise here, before any job is kept.
    generation = await ctx.engine.admit(params, endpoint="meshes", request_id=job.id)
    jobs.add(job)
    job.runner = asyncio.ensure_future(_drive(ctx, jobs, job, generation, received))
    ctx.jobs.track(job.id, job.runner, lambda error: jobs.finish(job.id, "failed", error=error))
    return job.to_dict()


def _get(request: Request, mesh_id: str) -> MeshJob:
    job = _jobs(request).get(mesh_id)
    if job is None:
        raise NotFoundError(f"No mesh job {mesh_id!r}.", param="mesh_id")
    return job_routes.refresh(server_context(request), _jobs(request), job)


@router.get("/v1/meshes", tags=["meshes"])
async def list_meshes(
    request: Request,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    try:
        page, has_more = _jobs(request).list(limit=limit, after=after, newest_first=order == "desc")
    except KeyError:
        raise InvalidRequestError(f"after={after!r} is not a kept mesh job id.", param="after") from None
    return job_routes.list_page([job.to_dict() for job in page], has_more)


@router.get("/v1/meshes/{mesh_id}", tags=["meshes"])
async def get_mesh(mesh_id: str, request: Request) -> dict[str, Any]:
    return _get(request, mesh_id).to_dict()


@router.get(
    "/v1/meshes/{mesh_id}/content",
    tags=["meshes"],
    response_class=Response,
    responses={200: {"content": {"model/gltf-binary": {}, "text/plain": {}}}},
)
async def mesh_content(mesh_id: str, request: Request) -> Response:
    job = _get(request, mesh_id)
    content = await run_in_threadpool(_jobs(request).content, job) if job.status == "completed" else None
    if content is None:
        raise MeshNotReadyError(
            f"Mesh job {mesh_id} is {job.status}; poll GET /v1/meshes/{{id}} until completed.", param="mesh_id"
        )
    return Response(
        content=content,
        media_type=MESH_FORMATS[job.output_format],
        headers={"Content-Disposition": f'inline; filename="{job.id}.{job.output_format}"'},
    )


@router.post("/v1/meshes/{mesh_id}/cancel", tags=["meshes"])
async def cancel_mesh(mesh_id: str, request: Request) -> dict[str, Any]:
    job = _get(request, mesh_id)
    if job.terminal and job.status != "cancelled":
        raise MeshNotReadyError(
            f"Mesh job {mesh_id} already {job.status}; DELETE it to remove it.",
            param="mesh_id",
            code="mesh_already_finished",
        )
    job_routes.cancel(server_context(request), _jobs(request), job, f"POST /v1/meshes/{mesh_id}/cancel")
    return _get(request, mesh_id).to_dict()


@router.delete("/v1/meshes/{mesh_id}", tags=["meshes"])
async def delete_mesh(mesh_id: str, request: Request) -> dict[str, Any]:
    job = _get(request, mesh_id)
    job_routes.cancel(server_context(request), _jobs(request), job, f"DELETE /v1/meshes/{mesh_id}")
    _jobs(request).remove(mesh_id)
    return {"id": mesh_id, "object": "mesh.deleted", "deleted": True}
