"""Image encoding for responses and guarded decoding for uploaded inputs.

Encoding turns a generated `PIL.Image` into PNG, JPEG or WebP bytes. Decoding is the untrusted
direction (edit uploads, image conditioning): it reads only the header first and refuses anything
larger than the caller's pixel budget before a single pixel is decompressed, because a few KiB of
PNG can expand into gigabytes (a decompression bomb).
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from diffuserve.errors import InvalidRequestError

#: Output formats the server can encode, mapped to (Pillow format name, MIME type).
_FORMATS: dict[str, tuple[str, str]] = {
    "png": ("PNG", "image/png"),
    "jpeg": ("JPEG", "image/jpeg"),
    "webp": ("WEBP", "image/webp"),
}
#: Spellings users reach for that mean the same format.
_ALIASES = {"jpg": "jpeg"}

#: Container formats accepted on upload. A closed list keeps rarely used (and rarely hardened)
#: Pillow decoders out of reach of request bodies.
_DECODE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
ACCEPTED_FORMATS = "PNG, JPEG, WebP, GIF or BMP"
"""The input formats `_DECODE_FORMATS` reads, as every message and the docs name them (one list)."""


def normalize_format(fmt: str, *, param: str = "output_format") -> str:
    """The canonical name (`png`, `jpeg`, `webp`) for `fmt`; InvalidRequestError naming `param` otherwise."""
    key = _ALIASES.get(fmt.strip().lower(), fmt.strip().lower())
    if key not in _FORMATS:
        raise InvalidRequestError(f"unsupported image format {fmt!r}; use one of {', '.join(_FORMATS)}", param=param)
    return key


def mime_type(fmt: str) -> str:
    """The MIME type for an output format name, e.g. `mime_type("webp") == "image/webp"`."""
    return _FORMATS[normalize_format(fmt)][1]


def _flatten_alpha(image: Image.Image) -> Image.Image:
    """An RGB copy for formats without alpha, composited over white.

    A bare `convert("RGB")` would expose whatever colour the transparent pixels happen to hold.
    """
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if image.mode != "RGB":
        return image.convert("RGB")
    return image


def encode_image(image: Image.Image, fmt: str, quality: int) -> bytes:
    """Encode `image` as `fmt` (png | jpeg | webp) and return the bytes.

    `quality` (1-100) applies to JPEG and WebP; PNG is lossless and ignores it. JPEG has no alpha
    channel, so RGBA input is flattened over white first.
    """
    key = normalize_format(fmt)
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise InvalidRequestError(
            f"output_quality must be an integer from 1 to 100, got {quality!r}", param="output_quality"
        )
    pil_format = _FORMATS[key][0]
    buffer = io.BytesIO()
    if key == "png":
        if image.mode not in ("RGB", "RGBA", "L", "LA", "P", "I", "1"):
            image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
        # Level 6 is close to the smallest size at a fraction of level 9's time.
        image.save(buffer, format=pil_format, compress_level=6)
    elif key == "jpeg":
        _flatten_alpha(image).save(buffer, format=pil_format, quality=quality)
    else:
        if image.mode not in ("RGB", "RGBA"):
            image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
        image.save(buffer, format=pil_format, quality=quality)
    return buffer.getvalue()


def decode_image(data: bytes, *, max_pixels: int, param: str = "image", limit_flag: str | None = None) -> Image.Image:
    """Decode uploaded image bytes into an RGB or RGBA image of at most `max_pixels` pixels.

    Raises InvalidRequestError(param=param) when the bytes are not an image in an accepted format,
    when the header declares more than `max_pixels` pixels (checked before decoding, so oversized
    input costs no memory), or when the pixel data is truncated or corrupt. EXIF orientation is
    applied so a phone photo arrives the way it looks. Animated input yields its first frame.
    """
    if not data:
        raise InvalidRequestError(f"{param} is empty; send the bytes of a {ACCEPTED_FORMATS} image", param=param)
    try:
        with warnings.catch_warnings():
            # Pillow warns (and past 2x its own limit raises) for huge images; our own budget below
            # is stricter, so its warning is noise here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=_DECODE_FORMATS)
    except Image.DecompressionBombError as exc:
        # Pillow's own hard limit fired while reading the header: far beyond any budget of ours.
        raise InvalidRequestError(
            f"{param} declares far more pixels than the limit of {max_pixels}"
            f"{f' (set by {limit_flag})' if limit_flag else ''} ({exc}); "
            "downscale it before uploading",
            param=param,
        ) from exc
    except UnidentifiedImageError as exc:
        # Pillow's message names an in-memory object (`<_io.BytesIO object at 0x...>`): useless to a client.
        raise InvalidRequestError(f"{param}: not a {ACCEPTED_FORMATS} file", param=param) from exc
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"{param} could not be read as an image ({exc}); send {ACCEPTED_FORMATS} bytes",
            param=param,
        ) from exc

    # 1. The header alone gives the size: refuse before any pixel is decompressed.
    width, height = image.size
    if width <= 0 or height <= 0 or width * height > max_pixels:
        limit = f"{max_pixels} pixels" + (f", set by {limit_flag}" if limit_flag else "")
        raise InvalidRequestError(
            f"{param} is {width}x{height} = {width * height} pixels, above the limit of {limit}; "
            "downscale it before uploading",
            param=param,
        )

    # 2. Decode the pixels. Corrupt or truncated data surfaces here, not at open().
    try:
        image.load()
        image = ImageOps.exif_transpose(image) or image
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(
            f"{param} is damaged or truncated ({exc}); re-encode the image and try again", param=param
        ) from exc

    # 3. Give callers one of two modes so pipelines need no per-format branches.
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    return image.convert("RGBA" if has_alpha else "RGB")
