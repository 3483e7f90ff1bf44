"""`generate`'s inpainting inputs: `--mask-path` and `--padding-mask-crop` (their flags, and the mask read and checked
as POST /v1/images/edits checks `mask`, before the model loads)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError, InvalidRequestError


def add_mask_flags(add: Callable[..., Any]) -> None:
    """The two flags, in `generate`'s Generation group (`add` is that group's `add_argument`)."""
    add(
        "--mask-path",
        metavar="PATH",
        help="With --image-path on a family that inpaints: a PNG the size of the image whose fully transparent "
        "pixels are repainted (OpenAI's `mask`; without alpha, white = repaint). Checked as POST /v1/images/edits "
        "checks `mask`, before the model loads.",
    )
    add(
        "--padding-mask-crop",
        type=int,
        metavar="PX",
        help="With --mask-path: repaint only a crop around the mask grown by PX pixels, pasted back over the image "
        "(diffusers' padding_mask_crop).",
    )


def read_mask(values: dict[str, Any], images: tuple[bytes, ...], max_side: int) -> bytes | None:
    """The `--mask-path` file as the pipelines take it (`media/masks.py`), checked as the edit API checks `mask`:
    an image the size of the first `--image-path` (alpha 0 = repaint; without alpha, white = repaint)."""
    from diffuserve.media.images import decode_image
    from diffuserve.media.masks import inpaint_mask

    path = values.get("mask_path")
    if path is None:
        if values.get("padding_mask_crop") is not None:
            raise ConfigError("--padding-mask-crop needs --mask-path (the region it crops around).")
        return None
    if not images:
        raise ConfigError("--mask-path needs --image-path: the mask marks where to repaint that image.")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--mask-path {path}: cannot read it ({exc.strerror or exc}).") from None
    size = decode_image(images[0], max_pixels=2**62).size
    try:
        return inpaint_mask(data, image_size=size, max_pixels=max_side**2)
    except InvalidRequestError as exc:
        raise ConfigError(f"--mask-path {path}: {exc.message}") from None


def check_mask_family(values: dict[str, Any], family: Any, backend: str) -> None:
    """`--mask-path` only for a family that inpaints natively (its spec's `inpaint` task), before loading."""
    if values.get("mask_path") is not None and not (family.inpaints and backend == "native"):
        from diffuserve.family_spec.request_rules import mask_refusal

        raise ConfigError(f"--mask-path: {mask_refusal(family.name).message}")
