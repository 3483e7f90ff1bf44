"""Inpainting masks: what a client sends (OpenAI's alpha mask, or a plain black-and-white picture) -> the one form
the pipelines take (`SamplingParams.mask_input`): a grayscale PNG, white = repaint, black = keep, the convention of
diffusers' `mask_image`.

The rule, in one place for the HTTP routes and `generate`:
- a mask with an alpha channel follows OpenAI: fully transparent pixels (alpha 0) are repainted, every other pixel
  is kept (its colour does not matter);
- a mask without alpha is read as diffusers reads it: its luminance, white (>= 50%) = repaint.
- it must be an image, and exactly the size of the (first) input image, else a 400 naming the field.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from diffuserve.errors import InvalidRequestError
from diffuserve.media.images import decode_image

DATA_URL_PREFIX = "data:"


def mask_bytes_from_text(value: str, *, param: str = "mask") -> bytes:
    """A mask sent as a form string: a base64 `data:` URL, or bare base64 (vLLM-Omni's clients send their image
    fields so), decoded locally. Remote URLs are not fetched here; anything else is a 400 naming `param`."""
    import base64
    import binascii

    text = value.split(";base64,", 1)[1] if value.startswith(DATA_URL_PREFIX) and ";base64," in value else value
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            f"{param} must be an uploaded image file (multipart) or base64 image bytes (a `data:image/png;base64,...` "
            f"URL or bare base64); got a string starting {value[:24]!r}.",
            param=param,
        ) from None


def inpaint_mask(data: bytes, *, image_size: tuple[int, int], max_pixels: int, param: str = "mask") -> bytes:
    """Check an uploaded mask against its image and return it as a grayscale PNG (white = repaint).

    `image_size` is the (width, height) of the first input image: OpenAI requires the mask to match it, and so do
    we (a mask of another size would silently move the edited region once both are resized to the output)."""
    image = decode_image(data, max_pixels=max_pixels, param=param)
    if image.size != tuple(image_size):
        raise InvalidRequestError(
            f"{param} is {image.width}x{image.height} but the image is {image_size[0]}x{image_size[1]}; the mask "
            "must be exactly the size of the (first) image.",
            param=param,
        )
    return encode_mask(to_repaint_mask(image))


def to_repaint_mask(image: Image.Image) -> Image.Image:
    """RGBA: alpha 0 -> white (repaint), else black (keep). RGB: its luminance (diffusers' reading)."""
    if image.mode == "RGBA":
        alpha = np.asarray(image.getchannel("A"))
        return Image.fromarray(np.where(alpha == 0, 255, 0).astype("uint8"), mode="L")
    return image.convert("L")


def encode_mask(mask: Image.Image) -> bytes:
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()
