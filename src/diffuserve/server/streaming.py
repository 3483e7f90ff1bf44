"""Streaming image responses: Server-Sent Events in the OpenAI images API's shape.

For `stream: true` the request is admitted first (so 400/429/503 are ordinary JSON answers), then the
response is `text/event-stream`: `<prefix>.partial_image` events (with `partial_image_index`) while the
batch denoises, then one `<prefix>.completed` event per image (with `usage`), where the prefix is
`image_generation` for generations and `image_edit` for edits. Each event also carries `output_index`
(which of the request's `n` images it belongs to). A failure after the stream began is an `error`
event with the usual error object, which the official SDK raises as an APIError.

Streaming requests batch like any other: the worker makes the batch's previews once per chosen step
and hands each request its own rows. A client that disconnects mid-stream aborts its request (a queued
one never runs; a running row is dropped, and the batch stops when nobody in it still waits).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from diffuserve.engine.engine import GenerationResult
from diffuserve.errors import DiffuserveError, RequestCancelledError
from diffuserve.executor.messages import PreviewSink
from diffuserve.media.images import encode_image
from diffuserve.sampling import SamplingParams
from diffuserve.server.engine_client import EngineClient
from diffuserve.server.protocol import error_envelope


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _encode_all(images: list[Any], params: SamplingParams) -> list[str]:
    return [base64.b64encode(encode_image(img, params.output_format, params.output_quality)).decode() for img in images]


async def stream_images(
    engine: EngineClient,
    params: SamplingParams,
    *,
    prefix: str,
    partial_images: int,
    common: dict[str, Any],
    usage: dict[str, Any],
    request_id: str,
    submit: dict[str, Any],
) -> StreamingResponse:
    """Admit the request now (errors raise to the caller as JSON answers) and stream its events.

    `common` holds the fields every event carries (size, quality, background, output_format);
    `submit` the engine's keyword arguments (endpoint, timeout_s, priority, ineligible_reason).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, list[Any]]] = asyncio.Queue()
    sink = PreviewSink(
        partial_images, lambda index, images: loop.call_soon_threadsafe(queue.put_nowait, (index, images))
    )
    future = await engine.admit(params, request_id=request_id, preview=sink if partial_images else None, **submit)

    def event(kind: str, b64: str, index: int, **extra: Any) -> bytes:
        return sse(
            f"{prefix}.{kind}",
            {
                "type": f"{prefix}.{kind}",
                "b64_json": b64,
                "created_at": int(time.time()),
                **common,
                "output_index": index,
                **extra,
            },
        )

    async def events() -> AsyncIterator[bytes]:
        answered = False
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    partial_index, images = getter.result()
                    for j, b64 in enumerate(await run_in_threadpool(_encode_all, images, params)):
                        yield event("partial_image", b64, j, partial_image_index=partial_index)
                    continue
                getter.cancel()
                break
            try:
                result: GenerationResult = future.result()
            except DiffuserveError as exc:
                answered = True
                yield sse(
                    "error", {"type": "error", **error_envelope(exc.message, exc.error_type, exc.param, exc.code)}
                )
                return
            finals = await run_in_threadpool(_encode_all, result.output.images, params)
            for j, b64 in enumerate(finals):
                yield event("completed", b64, j, usage=usage)
            answered = True
        finally:
            if getter is not None:
                # A client that leaves while this waits for the next preview cancels the wait, not the getter task:
                # left pending, asyncio logs "Task was destroyed but it is pending!" once the queue is collected.
                getter.cancel()
            if not answered:
                # The client went away (the server cancels this generator): drop the request's row.
                engine.abort(request_id, RequestCancelledError("The client disconnected from the stream."))

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
