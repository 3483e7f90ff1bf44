"""The body of POST /v1/images/edits in each shape clients send it, split into the request fields and the images.

- `multipart/form-data` (the official SDKs): `image` / `image[]` files; SGLang-Diffusion's and vLLM-Omni's
  clients add `url` / `url[]` form fields (what `extra_body={"url": ...}` becomes), data: or http(s) URLs, and an
  `image` part may itself be such a URL given as a plain form field;
- `application/x-www-form-urlencoded` (vLLM-Omni's test client posting `data={"url": [...]}`): the same fields,
  without files;
- `application/json` (OpenAI's JSON edit form): `images: [{"image_url": "data:..."}, ...]`, and `image` / `url`
  as a string, an object or a list of them.

The images keep their order: the `image` / `image[]` / `images` sources first, in body order, then `url` / `url[]`.
Fields that carry one extra image beside the sources (`OPTIONAL_IMAGE_FIELDS`: `mask`) are handed over as sent
(an upload, a URL string or an `{"image_url": ...}` object) for `media_sources.load_image_source`. Nothing is
fetched or decoded here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from diffuserve.errors import InvalidRequestError

IMAGE_SOURCE_FIELDS = ("image", "image[]", "images")
"""Fields whose values are the input images (uploads or URLs)."""
URL_SOURCE_FIELDS = ("url", "url[]")
"""SGLang-Diffusion's and vLLM-Omni's `url` extension: more input images, after those above."""
OPTIONAL_IMAGE_FIELDS = ("mask", "mask_image")
"""Fields that carry one image beside the sources; the route decides what to do with each."""
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def public_name(name: str) -> str:
    """The field an error names: `image[]` -> `image`, `url[]` -> `url`."""
    return name.removesuffix("[]")


@dataclass
class EditBody:
    """An edit request taken apart; values are as sent (uploads, URL strings, `{"image_url"}` objects)."""

    fields: dict[str, Any]
    """Every other field, for `ImageEditRequest` (form values are strings, JSON values typed)."""
    sources: list[tuple[str, Any]] = field(default_factory=list)
    """The input images, in order, each with the field that carried it (`image`, `images`, `url`)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Values of `OPTIONAL_IMAGE_FIELDS` that were given (the last one where a field is repeated)."""
    form: bool = True
    """Form fields (strings, which `coerce_form_fields` turns into numbers) rather than typed JSON values."""


async def read_edit_body(request: Request) -> EditBody:
    """The edit body of any supported content type; a 400 naming `body` for another."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(_FORM_TYPES):
        return _from_form(await request.form())
    if content_type.startswith("application/json"):
        try:
            data = await request.json()
        except ValueError:
            raise InvalidRequestError("The request body is not valid JSON.", param="body") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("The request body must be a JSON object.", param="body")
        return _from_json(data)
    raise InvalidRequestError(
        "POST /v1/images/edits takes multipart/form-data (an `image` file and a `prompt`), form fields with `url`, or "
        'a JSON object with `images: [{"image_url": "data:..."}]` and a `prompt`.',
        param="body",
    )


def _from_form(form: Any) -> EditBody:
    body = EditBody(fields={})
    images: list[tuple[str, Any]] = []
    urls: list[tuple[str, Any]] = []
    for key, value in form.multi_items():
        if key in IMAGE_SOURCE_FIELDS:
            images.append((public_name(key), value))
        elif key in URL_SOURCE_FIELDS:
            urls.append((public_name(key), value))
        elif key in OPTIONAL_IMAGE_FIELDS:
            body.extras[key] = value
        elif not isinstance(value, str):
            files = ", ".join(f"`{name}`" for name in (*IMAGE_SOURCE_FIELDS[:2], *OPTIONAL_IMAGE_FIELDS))
            raise InvalidRequestError(f"{key}: only {files} may be files.", param=key)
        else:
            body.fields[key] = value
    body.sources = images + urls
    return body


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _from_json(data: dict[str, Any]) -> EditBody:
    body = EditBody(fields={}, form=False)
    images: list[tuple[str, Any]] = []
    urls: list[tuple[str, Any]] = []
    for key, value in data.items():
        if value is None and key in (*IMAGE_SOURCE_FIELDS, *URL_SOURCE_FIELDS, *OPTIONAL_IMAGE_FIELDS):
            continue  # JSON null: the field is not given
        if key in IMAGE_SOURCE_FIELDS:
            images += [(public_name(key), item) for item in _as_list(value)]
        elif key in URL_SOURCE_FIELDS:
            urls += [(public_name(key), item) for item in _as_list(value)]
        elif key in OPTIONAL_IMAGE_FIELDS:
            body.extras[key] = value
        else:
            body.fields[key] = value
    body.sources = images + urls
    return body
