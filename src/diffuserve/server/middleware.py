"""ASGI middleware that runs before routing: trailing slashes, the body-size cap and API-key
authentication.

All answer in the OpenAI error envelope without reading more of the request than they must, and
count the answer in `diffuserve_error_responses_total` like the app's own error handler.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from diffuserve.server.playground import PUBLIC_PATHS as PLAYGROUND_PATHS
from diffuserve.server.protocol import error_envelope

Scope = dict[str, Any]

PUBLIC_PATHS = frozenset({"/liveness", "/health", "/metrics"}) | PLAYGROUND_PATHS
"""Paths that never need the API key (probes and scraping; the playground's static files, which hold no data)."""


ErrorCounter = Callable[[int, str], None]
"""count(status, code): records one error answer (EngineMetrics.observe_error)."""


async def _send_error(
    send: Any,
    status: int,
    message: str,
    error_type: str,
    code: str,
    headers: list | None = None,
    count: ErrorCounter | None = None,
) -> None:
    if count is not None:
        count(status, code)
    body = json.dumps(error_envelope(message, error_type, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TrailingSlashMiddleware:
    """Serve `/v1/images/generations/` as `/v1/images/generations`: a redirect (307) makes some clients
    drop the body of a POST, so the path is normalised before routing instead."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            if scope.get("raw_path"):
                scope["raw_path"] = scope["raw_path"].rstrip(b"/") or b"/"
        return await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Require `Authorization: Bearer KEY` everywhere except PUBLIC_PATHS; constant-time compare.

    The scheme is case-insensitive (RFC 7235: `bearer KEY` is the same credential)."""

    def __init__(self, app: Any, api_key: str, count: ErrorCounter | None = None):
        self.app = app
        self._expected = api_key.encode()
        self._count = count

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.strip().partition(b" ")
        ok = scheme.lower() == b"bearer"
        # Compare even when the scheme is wrong, so the answer time does not depend on the header.
        if not hmac.compare_digest(token.strip(), self._expected) or not ok:
            return await _send_error(
                send,
                401,
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                "authentication_error",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
                self._count,
            )
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answer 413 for bodies over the cap, from Content-Length up front or while streaming.

    `path_caps` gives some paths their own cap (uploads to /v1/images/edits); others get `max_bytes`.
    """

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        path_caps: dict[str, tuple[int, str]] | None = None,
        count: ErrorCounter | None = None,
    ):
        self.app = app
        self._count = count
        self.default_cap = (max_bytes, "--max-request-bytes")
        self.path_caps = path_caps or {}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        max_bytes, flag = self.path_caps.get(scope["path"], self.default_cap)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _send_error(
                        send,
                        400,
                        "Invalid Content-Length header.",
                        "invalid_request_error",
                        "invalid_value",
                        count=self._count,
                    )
                if declared > max_bytes:
                    return await self._too_large(send, max_bytes, flag)
        # Stream the body through, counting; past the cap stop reading and answer 413.
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > max_bytes:
                return await self._too_large(send, max_bytes, flag)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, send: Any, max_bytes: int, flag: str) -> None:
        await _send_error(
            send,
            413,
            f"The request body exceeds {max_bytes} bytes ({flag}).",
            "invalid_request_error",
            "request_too_large",
            count=self._count,
        )
