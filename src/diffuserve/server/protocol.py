"""Request and response shapes of the OpenAI-compatible API (pydantic v2).

Validation that needs no model lives here; what depends on the loaded family (size multiples)
is checked by the pipeline's `validate`. Every failure becomes HTTP 400 with `param` naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")

MAX_SEED = 2**63 - 1


def parse_size(size: str) -> tuple[int, int]:
    """'WxH' -> (W, H); ValueError with a message naming the expected form."""
    match = _SIZE_RE.match(size)
    if not match:
        raise ValueError(f"size must look like '1024x1024' (WIDTHxHEIGHT), got {size!r}")
    return int(match.group(1)), int(match.group(2))


class LoraEntry(BaseModel):
    """One adapter of a request's `lora` list: its name (from GET /v1/models) and the weight of its change."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="An adapter the server loaded (--lora-modules); GET /v1/models lists them.")
    scale: float = Field(
        default=1.0,
        description="Weight of the adapter's change (1 = as trained; summed over "
        "the list, as diffusers' set_adapters(adapter_weights=...)).",
    )


LoraField = str | list[LoraEntry] | None
"""The `lora` request field: an adapter name (scale 1), or a list of {name, scale} whose changes are summed."""


class PromptRequest(BaseModel):
    """What every generation body shares: prompt, model and size, validated once. Unknown fields are
    rejected (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(description="What to generate.")
    model: str | None = Field(default=None, description="Served model name; omitted = the served model.")
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, e.g. 1024x1024; omitted = the model's default.")
    step_cache: Any = Field(  # checked by config/step_cache.py, whose errors name the field
        default=None,
        description="Step cache of this request: a method (fbcache, teacache, taylorseer), an object "
        'with its options ({"method": "fbcache", "threshold": 0.1}), or "off"; omitted = the server\'s --step-cache.',
    )
    flow_shift: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description="The flow-matching scheduler's shift in place of the checkpoint's "
        "(static: it replaces resolution-dependent shifting), for models whose scheduler has one; else 400.",
    )
    enable_teacache: bool | None = Field(
        default=None, description='FastVideo / SGLang compatibility: true is {"method": "teacache"}.'
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt must not be empty")
        return value

    lora: LoraField = Field(
        default=None,
        description="LoRA adapter(s) for this request: a name, or a list of {name, scale} (summed). "
        "Requests with different adapters still share a batch. `model: <adapter name>` selects one too.",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_shape(cls, value: Any) -> Any:
        """One message for a malformed `lora` (pydantic's would name a branch of the union)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("lora must be an adapter name or a list of {name, scale}")
        for i, entry in enumerate(value):
            if not isinstance(entry, dict) or "name" not in entry or set(entry) - {"name", "scale"}:
                raise ValueError(f"lora[{i}] must be {{name, scale}} (scale optional), got {entry!r}")
        return value

    @field_validator("size")
    @classmethod
    def _size_form(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return None
        width, height = parse_size(value)
        if width < 1 or height < 1:
            raise ValueError(f"size {value!r} must have a positive width and height")
        return f"{width}x{height}"


class ImageGenerationRequest(PromptRequest):
    """Body of POST /v1/images/generations."""

    n: StrictInt = Field(default=1, ge=1, le=10, description="Images to generate for this prompt (1-10).")
    width: StrictInt | None = Field(default=None, ge=1, description="Alternative to size.")
    height: StrictInt | None = Field(default=None, ge=1, description="Alternative to size.")
    num_inference_steps: StrictInt | None = Field(default=None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(default=None, ge=0, le=100, description="Guidance scale.")
    true_cfg_scale: float | None = Field(
        default=None, ge=0, le=100, description="True CFG scale (needs negative_prompt)."
    )
    negative_prompt: str | None = Field(default=None, description="What not to draw.")
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED, description="Random seed (0 to 2^63-1).")
    response_format: Literal["b64_json", "url"] = Field(default="b64_json", description="b64_json (default) or url.")
    output_format: Literal["png", "jpeg", "webp"] = Field(default="png", description="Encoded image format.")
    output_quality: StrictInt = Field(default=90, ge=1, le=100, description="jpeg/webp quality.")
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds before the request is abandoned (capped by --request-timeout-s)."
    )
    priority: StrictInt = Field(default=0, ge=-100, le=100, description="Lower runs first among queued requests.")
    user: str | None = Field(
        default=None, max_length=256, description="End-user id (accepted for OpenAI compatibility)."
    )
    quality: Literal["low", "medium", "high", "auto", "standard", "hd"] | None = Field(
        default=None,
        description="Denoising effort when num_inference_steps is not given: low = 1/4, medium = 1/2, "
        "high = all of the model's default steps; auto/standard = the default, hd = high.",
    )
    style: str | None = Field(default=None, max_length=32, description="Accepted for OpenAI compatibility; ignored.")
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        default=None, description="auto or opaque (what every served family makes); transparent is refused."
    )
    moderation: Literal["auto", "low"] | None = Field(
        default=None, description="Accepted for OpenAI compatibility; no moderation is applied by this server."
    )
    output_compression: StrictInt | None = Field(
        default=None,
        ge=0,
        le=100,
        description="jpeg/webp only: 0-100, used as the encoder quality (100 = least "
        "compression); an alternative to output_quality.",
    )
    stream: bool = Field(
        default=False, description="Answer with Server-Sent Events: partial images, then one completed event per image."
    )
    partial_images: StrictInt | None = Field(
        default=None, ge=0, le=3, description="Streaming only: previews per image (0-3), at evenly spaced steps."
    )
    num_frames: StrictInt | None = Field(
        default=None,
        description="Accepted as 1 (SGLang-Diffusion's clients send it on every image call); any other "
        "value is refused.",
    )
    layers: StrictInt | None = Field(
        default=None,
        ge=1,
        le=10,
        description="Qwen-Image-Layered: the number of layers (vLLM-Omni's name for n; "
        "with n too, they must agree). Other models: 400.",
    )
    resolution: StrictInt | None = Field(
        default=None,
        description="Qwen-Image-Layered: the pipeline's resolution bucket, 640 or 1024. Other models: 400.",
    )
    # ControlNet (docs/api.md "ControlNet"; server/control_fields.py): per row, so such requests share batches.
    control_image: str | None = Field(
        default=None,
        description="ControlNet conditioning image (pose / edge / depth map ...) as a base64 data: URL, base64, or an "
        "http(s) URL where the server allows remote URLs; resized to the output size. Needs a server started "
        "with --controlnet; else 400.",
    )
    control_mode: StrictInt | None = Field(
        default=None, ge=0, description="Union ControlNets: the control type index (required there, refused elsewhere)."
    )
    controlnet_conditioning_scale: float | None = Field(
        default=None, description="Weight of the ControlNet's residuals (default 1.0, range 0-10)."
    )
    control_guidance_start: float | None = Field(
        default=None, description="Share of the steps before the ControlNet starts applying (default 0)."
    )
    control_guidance_end: float | None = Field(
        default=None, description="Share of the steps after which the ControlNet stops applying (default 1)."
    )
    controlnet: str | None = Field(
        default=None, description="Which loaded ControlNet (its --controlnet NAME) when several are loaded."
    )


class ImageEditRequest(ImageGenerationRequest):
    """Form fields of POST /v1/images/edits (multipart; the `image` file travels beside them)."""

    strength: float = Field(
        default=0.6, gt=0, le=1, description="Share of the schedule re-noised from the input image."
    )
    padding_mask_crop: StrictInt | None = Field(
        default=None,
        ge=0,
        description="With a mask: repaint only a crop around the masked region, grown by this many pixels, then paste "
        "it back over the image (diffusers' padding_mask_crop). Families that inpaint (see docs/families.md).",
    )


def coerce_form_fields(model: type[BaseModel], form: dict[str, str]) -> dict[str, object]:
    """Multipart values are strings: turn those of int/float fields into numbers for strict validation.

    A value that is not a number is left as is, so validation names the field.
    """
    coerced: dict[str, object] = {}
    for name, value in form.items():
        field = model.model_fields.get(name)
        kind = _numeric_kind(field.annotation) if field is not None else None
        try:
            coerced[name] = kind(value) if kind is not None else value
        except ValueError:
            coerced[name] = value
    return coerced


def _numeric_kind(annotation: object) -> type | None:
    """int or float when the annotation (through Optional/Annotated) is that number type."""
    if annotation in (int, float):
        return annotation  # type: ignore[return-value]
    for arg in get_args(annotation):
        kind = _numeric_kind(arg)
        if kind is not None:
            return kind
    return None


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class Timings(BaseModel):
    queue_wait_ms: float
    inference_ms: float
    encode_ms: float
    total_ms: float
    batch_size: int
    """Requests in the batch (the same as batch_requests; kept for existing clients)."""
    batch_requests: int = 1
    """Requests in the pipeline batch this request ran in."""
    batch_rows: int = 1
    """Rows (outputs) of the largest pipeline call it ran in: at most --batching-max-size in dynamic mode."""
    pipeline_calls: int = 1
    """Pipeline calls it ran as (> 1 when its n was above the row cap)."""
    batch_tokens: int = 0
    """Latent tokens of that call: its rows x each row's tokens (what --batching-max-tokens counts)."""
    stages_ms: dict[str, float] = {}
    step_cache: dict[str, Any] | None = None
    """The step cache its rows ran: method, computed_steps and reused_steps (summed over its rows); absent
    without one."""
    result_cache: str | None = None
    """With --result-cache-mib: "hit" (answered from the exact-result cache, no model call) or "miss"; absent
    without the cache."""


class UsageTokenDetails(BaseModel):
    text_tokens: int
    image_tokens: int


class Usage(BaseModel):
    """Token counts in OpenAI's shape: text tokens are the model's tokenizer's count of the prompt (and
    negative prompt); image tokens are the model's latent patches (one per size_multiple^2 pixels)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: UsageTokenDetails


class ImageGenerationResponse(BaseModel):
    id: str
    created: int
    model: str
    data: list[ImageData]
    output_format: str
    size: str
    seed: int
    timings: Timings
    warnings: list[str] = []
    """Things the server changed about the request, e.g. a prompt cut to what a text encoder takes."""
    background: str = "opaque"
    quality: str = "auto"
    usage: Usage | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorBody


def error_envelope(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
