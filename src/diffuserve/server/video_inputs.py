"""A video job's inputs: the JSON or multipart create body, and `input_reference` (a data URL, an upload, or with
`--allow-remote-urls` an http(s) URL fetched under the byte cap), decoded and checked before anything is queued."""

from __future__ import annotations

import base64
import binascii
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
from diffuserve.server.context import ServerContext
from diffuserve.server.protocol import coerce_form_fields
from diffuserve.server.video_params import VideoCreateRequest

router = APIRouter()
logger = logging.getLogger("diffuserve.server")

REFERENCE_FIELD = "input_reference"
"""The body field (and multipart part) that carries the reference image."""


async def reference_image(ctx: ServerContext, value: Any) -> bytes:
    """The bytes of `input_reference`: an upload, a `data:` URL (as a string or `{"image_url": ...}`), or a
    remote URL (fetched only with --allow-remote-urls). `{"file_id": ...}` names a file this server does not
    keep, so it is refused."""
    if hasattr(value, "read"):
        return await value.read()
    if isinstance(value, dict):
        if "file_id" in value and "image_url" not in value:
            raise InvalidRequestError(
                "input_reference.file_id is not supported (this server keeps no uploaded files); "
                "upload the image or give image_url as a data: URL.",
                param=REFERENCE_FIELD,
            )
        value = value.get("image_url")
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            'input_reference must be an uploaded image, a data: URL, or {"image_url": ...}.', param=REFERENCE_FIELD
        )
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header or not payload:
            raise InvalidRequestError(
                "input_reference: a data: URL must be base64 (data:image/png;base64,...).", param=REFERENCE_FIELD
            )
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise InvalidRequestError(
                "input_reference: the data: URL is not valid base64.", param=REFERENCE_FIELD
            ) from None
    if value.startswith(("http://", "https://")):
        if not ctx.args.allow_remote_urls:
            raise InvalidRequestError(
                "input_reference: remote URLs are not fetched unless the server runs with "
                "--allow-remote-urls; upload the image or send it as a data: URL.",
                param=REFERENCE_FIELD,
            )
        return await fetch_reference(value, ctx.args.max_upload_bytes)
    raise InvalidRequestError("input_reference: not a data: or http(s) URL.", param=REFERENCE_FIELD)


async def fetch_reference(url: str, max_bytes: int) -> bytes:
    """GET a remote image (operator opt-in), bounded in time and size."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0, follow_redirects=True) as client, client.stream("GET", url) as reply:
            reply.raise_for_status()
            data = b""
            async for chunk in reply.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise InvalidRequestError(
                        f"input_reference: {url} is larger than {max_bytes} bytes (--max-upload-bytes).",
                        param=REFERENCE_FIELD,
                    )
            return data
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"input_reference: could not fetch {url} ({exc}).", param=REFERENCE_FIELD) from None


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
    image = await reference_image(ctx, reference)
    await run_in_threadpool(decode_image, image, max_pixels=ctx.args.max_image_side**2, param=REFERENCE_FIELD)
    return body, image
