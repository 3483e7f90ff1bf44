"""One way to turn an image a request gives into bytes, for every route and field that takes a file.

`load_image_source(value, field, policy)` takes what a client put in a field such as `image`, `url`, `mask`,
`control_image`, `input_reference` or `input_image`:

- an upload (a multipart file part),
- a `data:` URL (`data:image/png;base64,...`), as a string or as `{"image_url": ...}` (OpenAI's JSON image
  reference, and `{"url": ...}` as chat-style clients write it),
- an `http(s)` URL, fetched only with `--allow-remote-urls` and then only safely (server/safe_fetch.py),

and answers the bytes, or a 400 naming `field` and the reason. It does not decode the image: callers check it with
`media.images.decode_image` under their own pixel cap, so that errors keep naming the field.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.server.safe_fetch import FetchPolicy, fetch_url

__all__ = ["FetchPolicy", "decode_data_url", "load_image_source"]


def decode_data_url(value: str, field: str) -> bytes:
    """The bytes of a base64 `data:` URL (`data:image/png;base64,...`); 400 naming `field` otherwise."""
    header, _, payload = value.partition(",")
    if ";base64" not in header or not payload:
        raise InvalidRequestError(f"{field}: a data: URL must be base64 (data:image/png;base64,...).", param=field)
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise InvalidRequestError(f"{field}: the data: URL is not valid base64.", param=field) from None


def _reference_url(value: dict, field: str) -> Any:
    """The URL inside `{"image_url": ...}` (or `{"url": ...}`); `file_id` names a file this server never keeps."""
    if "image_url" in value or "url" in value:
        inner = value.get("image_url", value.get("url"))
        return inner.get("url") if isinstance(inner, dict) else inner  # {"image_url": {"url": ...}} (chat shape)
    if "file_id" in value:
        raise InvalidRequestError(
            f"{field}.file_id is not supported (this server keeps no uploaded files); upload the image or give "
            'image_url as a data: URL ({"image_url": "data:image/png;base64,..."}).',
            param=field,
        )
    raise InvalidRequestError(
        f'{field}: an image object takes "image_url" (a data: URL, or an http(s) URL with --allow-remote-urls).',
        param=field,
    )


async def load_image_source(value: Any, field: str, policy: FetchPolicy) -> bytes:
    """The bytes of the image a request gave in `field` (see the module docstring). `policy` is
    `FetchPolicy.from_limits(ctx.args.limits)`: whether and how an http(s) URL is fetched."""
    if hasattr(value, "read"):
        return await value.read()
    if isinstance(value, dict):
        value = _reference_url(value, field)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(
            f'{field} must be an uploaded image, a data: URL or {{"image_url": ...}}; got {type(value).__name__}.',
            param=field,
        )
    value = value.strip()
    scheme = value.split(":", 1)[0].lower() if ":" in value else ""
    if scheme == "data":
        return decode_data_url(value, field)
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise InvalidRequestError(
                f"{field}: remote URLs are not fetched unless the server runs with --allow-remote-urls; upload the "
                "image or send it as a data: URL (data:image/png;base64,...).",
                param=field,
            )
        return await fetch_url(value, field, policy)
    raise InvalidRequestError(
        f"{field}: not an image: give an upload, a data: URL (data:image/png;base64,...) or an http(s) URL.",
        param=field,
    )
