"""The OpenAI request fields that change how a request runs or is reported: `quality` -> steps, `background`,
`output_compression`, and the `usage` token counts of a response.

Token counts (OpenAI's `usage` object, for diffusion models):
- text tokens: what the family spec's last text encoder (T5 for FLUX / SD3, UMT5 for Wan, else the family's
  one encoder) makes of the prompt and the negative prompt, truncated to the length the model reads. They are
  counted by the front end's `PromptTokens` (`pipelines/prompt_limits.py`, via `server/common.check_prompt`)
  in the same count as the truncation warnings, whose token ids the encode reuses (`pipelines/token_ids.py`);
  this module never touches a tokenizer;
- image tokens: one per `size_multiple x size_multiple` pixel patch (FLUX: the 16 px patches the transformer
  sees as tokens), for each output image (output tokens) and each input image of an edit (input tokens).
"""

from __future__ import annotations

import math

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import ModelDescription, SamplingParams

QUALITY_STEP_SHARE = {"low": 0.25, "medium": 0.5, "high": 1.0}
"""`quality` -> share of the family's default num_inference_steps (rounded up, at least 1)."""

_REPORTED_QUALITY = {"standard": "auto", "hd": "high"}
"""DALL-E's names, reported in the images API's own terms."""


def steps_for_quality(quality: str | None, default_steps: int) -> int | None:
    """Steps for a `quality` when the request gives no num_inference_steps; None = the default."""
    share = QUALITY_STEP_SHARE.get(_REPORTED_QUALITY.get(quality or "auto", quality or "auto"))
    return None if share is None else max(1, math.ceil(default_steps * share))


def reported_quality(quality: str | None) -> str:
    return _REPORTED_QUALITY.get(quality or "auto", quality or "auto")


def check_background(background: str | None, model: ModelDescription) -> str:
    """The background reported back ("opaque"); a transparent one is refused: no served family makes alpha."""
    if background == "transparent":
        raise InvalidRequestError(
            f"background='transparent' needs a model that makes an alpha channel; this {model.family} model makes "
            "opaque RGB images. Use background='opaque' or 'auto'.",
            param="background",
        )
    return "opaque"


def encoder_quality(
    output_format: str, output_quality: int, output_compression: int | None, quality_given: bool
) -> int:
    """The jpeg/webp encoder quality from output_quality or OpenAI's output_compression (not both)."""
    if output_compression is None:
        return output_quality
    if output_format == "png":
        raise InvalidRequestError(
            "output_compression applies to jpeg and webp only; png is lossless. Drop it or set output_format.",
            param="output_compression",
        )
    if quality_given:
        raise InvalidRequestError(
            "Give either output_compression or output_quality, not both.", param="output_compression"
        )
    return max(1, output_compression)  # Pillow's encoders take 1-100


def usage(
    model: ModelDescription,
    params: SamplingParams,
    *,
    text_tokens: int,
    input_sizes: list[tuple[int, int]] | None = None,
) -> dict[str, int | dict[str, int]]:
    """The `usage` object of one request (all its `n` images); `text_tokens` from the request's prompt count."""
    patch = max(1, model.size_multiple)
    per_image = (params.width // patch) * (params.height // patch)
    text = text_tokens
    image_in = sum((w // patch) * (h // patch) for w, h in (input_sizes or []))
    output = per_image * params.n
    return {
        "input_tokens": text + image_in,
        "output_tokens": output,
        "total_tokens": text + image_in + output,
        "input_tokens_details": {"text_tokens": text, "image_tokens": image_in},
    }
