"""POST /v1/images/generations and GET /v1/images/{id}/content."""

from __future__ import annotations

import asyncio
import base64
import functools
import time
import uuid
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from diffuserve.engine.engine import GenerationResult
from diffuserve.errors import InvalidRequestError, NotFoundError, RequestCancelledError
from diffuserve.family_spec.request_rules import mask_refusal
from diffuserve.media.images import decode_image, encode_image, mime_type
from diffuserve.media.masks import inpaint_mask, mask_bytes_from_text
from diffuserve.sampling import SamplingParams, build_sampling_params, check_request_fields
from diffuserve.server.common import (
    check_image_only_fields,
    check_request_limits,
    count_prompt,
    layer_count,
    request_step_cache,
    require_ready,
    result_timings,
    served_model,
    server_context,
)
from diffuserve.server.context import ServerContext, StoredImage
from diffuserve.server.control_fields import load_control_image, request_control
from diffuserve.server.edit_inputs import read_edit_body
from diffuserve.server.lora_fields import base_model_name, request_loras
from diffuserve.server.media_sources import FetchPolicy, load_image_source
from diffuserve.server.protocol import (
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    Timings,
    Usage,
    coerce_form_fields,
    parse_size,
)
from diffuserve.server.result_cache import CacheKey, cached_timings
from diffuserve.server.streaming import stream_images
from diffuserve.server.usage import (
    check_background,
    encoder_quality,
    reported_quality,
    steps_for_quality,
    usage,
)

router = APIRouter()


def image_params(
    body: ImageGenerationRequest,
    ctx: ServerContext,
    *,
    image_inputs: tuple[bytes, ...] = (),
    strength: float = 1.0,
    control_image: bytes | None = None,
    mask_input: bytes | None = None,
) -> SamplingParams:
    """Request body -> SamplingParams through the one builder, after the server's own caps."""
    model = served_model(ctx)
    assert model is not None
    if model.output_kind != "image":
        route = "a mesh job with POST /v1/meshes" if model.output_kind == "mesh" else "a video job with POST /v1/videos"
        raise InvalidRequestError(
            f"The served model is a {model.family} {model.output_kind} model: it makes {model.outputs}, not "
            f"images. Create {route} instead.",
            param="model",
            code="model_not_supported",
        )
    if body.size is not None:
        if body.width is not None or body.height is not None:
            raise InvalidRequestError("Give either size or width/height, not both.", param="size")
        width, height = parse_size(body.size)
    else:
        width, height = body.width or model.defaults.width, body.height or model.defaults.height
    check_image_only_fields(body.num_frames)
    check_request_fields(model, {"layers": body.layers})
    n = layer_count(body.n, "n" in body.model_fields_set, body.layers)
    check_background(body.background, model)
    steps = (
        body.num_inference_steps
        or steps_for_quality(body.quality, model.defaults.num_inference_steps)
        or model.defaults.num_inference_steps
    )
    quality = encoder_quality(
        body.output_format, body.output_quality, body.output_compression, "output_quality" in body.model_fields_set
    )
    if body.partial_images is not None and not body.stream:
        raise InvalidRequestError("partial_images needs stream=true.", param="partial_images")
    check_request_limits(
        ctx,
        model=base_model_name(ctx, body.model),
        texts={"prompt": body.prompt, "negative_prompt": body.negative_prompt},
        width=width,
        height=height,
        steps=steps,
    )
    lora = request_loras(ctx, body.lora, body.model)
    control = request_control(body, model, max_side=ctx.args.http.max_image_side, image=control_image)
    return build_sampling_params(
        model,
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=body.guidance_scale,
        true_cfg_scale=body.true_cfg_scale,
        seed=body.seed,
        n=n,
        output_format=body.output_format,
        output_quality=quality,
        image_inputs=image_inputs,
        mask_input=mask_input,
        padding_mask_crop=getattr(body, "padding_mask_crop", None),
        strength=strength,
        flow_shift=body.flow_shift,
        resolution=body.resolution,
        lora=lora,
        step_cache=request_step_cache(body, ctx),
        control=control,
    )


async def await_unless_disconnected(request: Request, coro) -> GenerationResult:
    """Await the engine; if the client goes away first, cancel (the engine aborts the request). The disconnect is
    awaited, not polled: a poll every 50 ms cost ~10 wake-ups of the event loop per request (serving CPU)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise RequestCancelledError("The client disconnected; the request was cancelled.")
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone: the server's ASGI `receive` answers `http.disconnect` then (the body
    was read before the request was queued, so nothing else reads `receive` meanwhile)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _generate_and_respond(
    request: Request,
    body: ImageGenerationRequest,
    params: SamplingParams,
    *,
    received: float,
    ineligible_reason: str | None = None,
    prefix: str = "image_generation",
) -> ImageGenerationResponse | StreamingResponse:
    """Run one request through the engine and shape the OpenAI response (shared by generations and edits)."""
    ctx = server_context(request)
    request_id = uuid.uuid4().hex
    # Before queueing, one count of the texts (in a worker thread, on the model's own tokenizer copies): a
    # too-long prompt is a 400 with --reject-truncated-prompts, else a warning (a streamed answer carries none;
    # the log says it either way); the same count gives the usage text tokens.
    prompt = await count_prompt(ctx, {"prompt": params.prompt, "negative_prompt": params.negative_prompt})
    warnings, params = prompt.warnings, prompt.carry(params)  # the encode reuses the count's ids: tokenize once
    assert ctx.engine.model is not None
    inputs = [(params.width, params.height)] * len(params.image_inputs)  # inputs are resized to the output size
    counted = usage(ctx.engine.model, params, text_tokens=prompt.text_tokens, input_sizes=inputs)
    if body.stream:
        common = {
            "size": f"{params.width}x{params.height}",
            "quality": reported_quality(body.quality),
            "background": "opaque",
            "output_format": params.output_format,
        }
        return await stream_images(
            ctx.engine,
            params,
            prefix=prefix,
            partial_images=body.partial_images or 0,
            common=common,
            usage=counted,
            request_id=request_id,
            submit={
                "endpoint": "images",
                "timeout_s": body.timeout,
                "priority": body.priority,
                "ineligible_reason": ineligible_reason,
            },
        )
    encoded, timings, key = await _answer(request, ctx, body, params, request_id, ineligible_reason, received)
    hit = timings.get("result_cache") == "hit"
    if body.response_format == "url":
        await run_in_threadpool(
            ctx.images.put, request_id, [StoredImage(data, mime_type(params.output_format)) for data in encoded]
        )
        base = str(request.base_url).rstrip("/")
        data = [ImageData(url=f"{base}/v1/images/{request_id}/content?index={i}") for i in range(len(encoded))]
    else:
        data = [ImageData(b64_json=base64.b64encode(blob).decode()) for blob in encoded]
    if key is not None:  # after the url row exists: an entry lives no longer than the newest row of its bytes
        record = request_id if body.response_format == "url" else None
        if not hit:
            ctx.result_cache.store(key, encoded, timings["step_cache"], record)  # type: ignore[union-attr]
        elif record is not None:
            ctx.result_cache.repoint(key, record)  # type: ignore[union-attr]
    return ImageGenerationResponse(
        id=request_id,
        created=int(time.time()),
        model=ctx.args.public_model_name,
        data=data,
        output_format=params.output_format,
        size=f"{params.width}x{params.height}",
        seed=params.seed or 0,
        timings=Timings(**timings),
        warnings=warnings,
        background="opaque",
        quality=reported_quality(body.quality),
        usage=Usage(**counted),
    )


async def _answer(
    request: Request,
    ctx: ServerContext,
    body: ImageGenerationRequest,
    params: SamplingParams,
    request_id: str,
    ineligible_reason: str | None,
    received: float,
) -> tuple[list[bytes], dict[str, Any], CacheKey | None]:
    """The encoded outputs and the `timings` of a (non-streamed) request: from the exact-result cache on a hit
    (server/result_cache.py), else from the engine. The third value is the request's cache key (None: no cache, or no
    seed given)."""
    cache, key = ctx.result_cache, None
    if cache is not None:  # off the event loop: the key hashes the input images, a lookup may ask the store
        key = await run_in_threadpool(lambda: cache.key(params, seed_given=body.seed is not None))
        hit = await run_in_threadpool(cache.lookup, key)
        if hit is not None:
            ctx.metrics.observe_request("images", "success", time.monotonic() - received)
            return list(hit.blobs), cached_timings(hit.step_cache, received), key
    result = await await_unless_disconnected(
        request,
        ctx.engine.generate(
            params,
            endpoint="images",
            timeout_s=body.timeout,
            priority=body.priority,
            request_id=request_id,
            ineligible_reason=ineligible_reason,
        ),
    )
    encode_started = time.monotonic()
    encoded = await run_in_threadpool(
        lambda: [encode_image(img, params.output_format, params.output_quality) for img in result.output.images]
    )
    timings = result_timings(result, encode_s=time.monotonic() - encode_started, received=received, metrics=ctx.metrics)
    if cache is not None:
        timings["result_cache"] = "miss"
    return encoded, timings, key


_STREAM_RESPONSE = {
    200: {
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": "The images (JSON), or with stream=true Server-Sent Events.",
    }
}


@router.post(
    "/v1/images/generations", tags=["images"], response_model=ImageGenerationResponse, responses=_STREAM_RESPONSE
)
async def create_image(body: ImageGenerationRequest, request: Request) -> ImageGenerationResponse | StreamingResponse:
    received = time.monotonic()
    ctx = server_context(request)
    require_ready(ctx)
    control_image = await load_control_image(body, FetchPolicy.from_limits(ctx.args.limits))
    return await _generate_and_respond(
        request, body, image_params(body, ctx, control_image=control_image), received=received
    )


_MASK_FIELDS = ("mask", "mask_image")
"""The inpainting mask: OpenAI's `mask`, and vLLM-Omni's name for the same thing (`mask_image`)."""


async def _edit_mask(extras: dict[str, Any], ctx: ServerContext, image_size: tuple[int, int]) -> bytes | None:
    """The request's mask (an upload, a data: URL or bare base64, `{"image_url": ...}`, or an http(s) URL under
    --allow-remote-urls and its guards) as the pipelines take it (`media/masks.py`), checked before queueing: the
    model inpaints, it is an image, and it is the size of the first image. None: no mask."""
    given = [(k, extras[k]) for k in _MASK_FIELDS if k in extras]
    if not given:
        return None
    model = served_model(ctx)
    assert model is not None
    if not model.inpaints:
        raise mask_refusal(model.family)
    if len(given) > 1:
        raise InvalidRequestError(f"Send one mask; got {len(given)} ({', '.join(k for k, _ in given)}).", param="mask")
    name, value = given[0]
    if isinstance(value, str) and not value.startswith(("data:", "http://", "https://")):
        data = mask_bytes_from_text(value, param=name)  # bare base64, as vLLM-Omni's clients send image fields
    else:
        data = await load_image_source(value, name, FetchPolicy.from_limits(ctx.args.limits))
    side = ctx.args.http.max_image_side
    return await run_in_threadpool(
        functools.partial(inpaint_mask, data, image_size=image_size, max_pixels=side**2, param=name)
    )


@router.post(
    "/v1/images/edits",
    tags=["images"],
    response_model=ImageGenerationResponse,
    responses=_STREAM_RESPONSE,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["image", "prompt"],
                        "properties": {
                            "image": {"type": "string", "format": "binary"},
                            "mask": {
                                "type": "string",
                                "format": "binary",
                                "description": "PNG the size of the image; fully transparent pixels are repainted "
                                "(without alpha: white = repaint). Families that inpaint.",
                            },
                            **{k: v for k, v in ImageEditRequest.model_json_schema()["properties"].items()},
                        },
                    }
                },
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["images", "prompt"],
                        "properties": {
                            "images": {
                                "type": "array",
                                "items": {"type": "object", "properties": {"image_url": {"type": "string"}}},
                                "description": "data: URLs (http(s) URLs with --allow-remote-urls).",
                            },
                            **{k: v for k, v in ImageEditRequest.model_json_schema()["properties"].items()},
                        },
                    }
                },
            },
        },
    },
)
async def edit_image(request: Request) -> ImageGenerationResponse | StreamingResponse:
    """Image-to-image, with an optional inpainting `mask`: multipart (OpenAI's SDK shape), form fields or JSON, the
    images as files, data: URLs or (with --allow-remote-urls) http(s) URLs (server/edit_inputs.py). Each edit runs
    alone: image-conditioned requests never merge at the server (a pipeline batch carries masks per row)."""
    received = time.monotonic()
    ctx = server_context(request)
    require_ready(ctx)
    edit = await read_edit_body(request)
    if "control_image" in edit.fields:  # checked before the body (an uploaded one is refused as a file part)
        raise InvalidRequestError(
            "control_image: ControlNet runs on text-to-image (POST /v1/images/generations); an edit takes none.",
            param="control_image",
        )
    limit = ctx.engine.model.max_image_inputs  # type: ignore[union-attr]
    if not edit.sources or len(edit.sources) > max(limit, 1):
        allowed = "exactly one image" if limit <= 1 else f"1 to {limit} images (repeated `image[]`, `images` or `url`)"
        raise InvalidRequestError(
            f'Send {allowed}: an `image` file, a data: URL in `url` or `images: [{{"image_url": ...}}]`; got '
            f"{len(edit.sources)}.",
            param="image",
        )
    try:
        fields = coerce_form_fields(ImageEditRequest, edit.fields) if edit.form else edit.fields
        body = ImageEditRequest.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc
    policy = FetchPolicy.from_limits(ctx.args.limits)
    blobs = tuple([await load_image_source(value, name, policy) for name, value in edit.sources])
    side = ctx.args.http.max_image_side
    decode = functools.partial(
        decode_image,
        max_pixels=side**2,
        limit_flag=f"--max-image-side {side} (at most {side}x{side} pixels)",
    )
    sources = [
        await run_in_threadpool(decode, data, param=name) for data, (name, _) in zip(blobs, edit.sources, strict=True)
    ]
    mask = await _edit_mask(edit.extras, ctx, sources[0].size)
    if body.size is None and body.width is None and body.height is None:
        # Default to the (first) input's size, rounded down to what the model can produce.
        multiple = ctx.engine.model.size_multiple  # type: ignore[union-attr]
        if max(sources[0].size) > side:  # the output would take this size: the image is what is too large
            raise InvalidRequestError(
                f"image is {sources[0].width}x{sources[0].height}; without size the output takes the input's size, "
                f"and its sides must be at most {side} (--max-image-side). Downscale the image or give size.",
                param="image",
            )
        body = body.model_copy(
            update={
                "width": max(multiple, sources[0].width // multiple * multiple),
                "height": max(multiple, sources[0].height // multiple * multiple),
            }
        )
    params = image_params(body, ctx, image_inputs=blobs, strength=body.strength, mask_input=mask)
    return await _generate_and_respond(
        request, body, params, received=received, ineligible_reason="image_conditioning", prefix="image_edit"
    )


@router.get(
    "/v1/images/{image_id}/content",
    tags=["images"],
    response_class=Response,
    responses={
        200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}, "description": "The encoded image."}
    },
)
async def image_content(image_id: str, request: Request, index: int = Query(default=0, ge=0)) -> Response:
    ctx = server_context(request)
    if ctx.args.store.media_presign_s > 0:  # --media-store with --media-presign-s: the client fetches from the bucket
        url = await run_in_threadpool(ctx.images.presign, image_id, index, ctx.args.store.media_presign_s)
        if url is not None:
            return RedirectResponse(url, status_code=307)
    images = await run_in_threadpool(ctx.images.get, image_id)
    if images is None:
        raise NotFoundError(f"No image {image_id!r} (unknown id, or dropped from the URL store).", param="image_id")
    if index >= len(images):
        raise InvalidRequestError(
            f"index={index} is out of range: this result has {len(images)} image(s).", param="index"
        )
    item = images[index]
    return Response(content=item.data, media_type=item.media_type)
