"""A video job's inputs: the JSON or multipart create body, and `input_reference` (a data URL, an upload, or with
`--allow-remote-urls` an http(s) URL fetched safely, server/media_sources.py), decoded and checked before anything is
queued."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from diffuserve.errors import (
    InvalidRequestError,
)
from diffuserve.media.images import decode_image
from diffuserve.server.common import server_context
from diffuserve.server.media_sources import FetchPolicy, load_image_source
from diffuserve.server.protocol import coerce_form_fields
from diffuserve.server.video_params import VideoCreateRequest

router = APIRouter()
logger = logging.getLogger("diffuserve.server")

REFERENCE_FIELD = "input_reference"
"""The body field (and multipart part) that carries the reference image."""


async def create_body(request: Request) -> tuple[VideoCreateRequest, bytes | None]:
    """The body as JSON, or as form fields (the official SDK always sends `videos.create` as multipart),
    and the input image's bytes when the job has one."""
    ctx = server_context(request)
    content_type = request.headers.get("content-type", "")
    reference: Any = None
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form()
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if key == REFERENCE_FIELD:
                reference = value  # an upload (or a data:/http(s) URL given as a plain form field)
            elif not isinstance(value, str):
                raise InvalidRequestError(f"{key}: only input_reference may be a file.", param=key)
            else:
                fields[key] = value
        data: Any = coerce_form_fields(VideoCreateRequest, fields)
    else:
        try:
            data = await request.json()
        except ValueError:
            raise InvalidRequestError(
                "The request body must be a JSON object (Content-Type: application/json) or multipart form fields.",
                param="body",
            ) from None
        if isinstance(data, dict):
            reference = data.pop(REFERENCE_FIELD, None)
    try:
        body = VideoCreateRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc
    if reference is None:
        return body, None
    image = await load_image_source(reference, REFERENCE_FIELD, FetchPolicy.from_limits(ctx.args.limits))
    await run_in_threadpool(decode_image, image, max_pixels=ctx.args.http.max_image_side**2, param=REFERENCE_FIELD)
    return body, image
