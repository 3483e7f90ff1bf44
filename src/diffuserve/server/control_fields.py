"""The ControlNet request fields (`control_image`, `control_mode`, `controlnet_conditioning_scale`,
`control_guidance_start` / `_end`, `controlnet`; docs/api.md "ControlNet") -> `ControlRequest`, checked before
anything is queued: an image that is not one, a companion field without `control_image` or a field the served model
does not take is a 400 naming the field. What depends on the loaded ControlNets (names, Union modes) is checked
against the model's request rules (`family_spec/request_rules.py` `check_control`), which the one builder runs.

`control_image` is a base64 `data:` URL, bare base64, `{"image_url": ...}`, or an http(s) URL that the server fetches
only with `--allow-remote-urls`, under the guards of `server/safe_fetch.py` (`load_control_image`, one loader for every
image field: `server/media_sources.py`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import ControlRequest, ModelDescription, check_request_fields

FIELD = "control_image"
COMPANIONS = (
    "control_mode",
    "controlnet_conditioning_scale",
    "control_guidance_start",
    "control_guidance_end",
    "controlnet",
)
"""Fields that mean something only beside `control_image`."""


async def load_control_image(body: Any, policy: Any) -> bytes | None:
    """The bytes of the request's `control_image` (None without one): bare base64 is decoded here; a data: URL, an
    `{"image_url": ...}` object or an http(s) URL go through the one loader (`load_image_source`, whose fetch is off
    unless `--allow-remote-urls` and guarded when on). `policy`: `FetchPolicy.from_limits(ctx.args.limits)`."""
    from diffuserve.server.media_sources import load_image_source

    value = getattr(body, FIELD, None)
    if value is None:
        return None
    if isinstance(value, str) and not value.startswith(("data:", "http://", "https://")):
        return control_image_bytes(value)
    return await load_image_source(value, FIELD, policy)


def control_image_bytes(value: Any) -> bytes:
    """The bytes of a bare-base64 (or base64 data: URL) `control_image` value."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(
            f"{FIELD} must be an image as a base64 data: URL (data:image/png;base64,...) or base64.", param=FIELD
        )
    payload = value
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header or not payload:
            raise InvalidRequestError(f"{FIELD}: not a base64 data: URL (data:image/png;base64,...).", param=FIELD)
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{FIELD}: not valid base64.", param=FIELD) from None


def request_control(body: Any, model: ModelDescription, *, max_side: int, image: bytes | None) -> ControlRequest | None:
    """The request's ControlRequest (None without `control_image`), its image (`image`, from `load_control_image`)
    decoded once to check it (formats and the `--max-image-side` pixel cap, as uploads)."""
    from diffuserve.media.images import decode_image

    value = getattr(body, FIELD, None)
    if value is None:
        given = next((name for name in COMPANIONS if getattr(body, name, None) is not None), None)
        if given is not None:
            raise InvalidRequestError(f"{given} applies with control_image; send the control image too.", param=given)
        return None
    check_request_fields(model, {FIELD: value})
    data = image if image is not None else control_image_bytes(value)
    decode_image(
        data,
        max_pixels=max_side**2,
        param=FIELD,
        limit_flag=f"--max-image-side {max_side} (at most {max_side}^2 pixels)",
    )
    return ControlRequest(
        image=data,
        name=body.controlnet,
        mode=body.control_mode,
        scale=1.0 if body.controlnet_conditioning_scale is None else body.controlnet_conditioning_scale,
        start=0.0 if body.control_guidance_start is None else body.control_guidance_start,
        end=1.0 if body.control_guidance_end is None else body.control_guidance_end,
    )


def generate_control(values: dict[str, Any], model: ModelDescription) -> ControlRequest | None:
    """`generate`'s `--control-image` and companions (config/controlnet.py) -> the ControlRequest of every prompt,
    checked as the request fields are."""
    from pathlib import Path

    from diffuserve.media.images import decode_image

    path = values.get("control_image")
    if path is None:
        return None
    check_request_fields(model, {FIELD: path})
    data = Path(path).expanduser().read_bytes()
    decode_image(data, max_pixels=2**62, param=FIELD)
    scale, start, end = (values.get(k) for k in COMPANIONS[1:4])
    return ControlRequest(
        image=data,
        name=values.get("controlnet_name"),
        mode=values.get("control_mode"),
        scale=1.0 if scale is None else scale,
        start=0.0 if start is None else start,
        end=1.0 if end is None else end,
    )
