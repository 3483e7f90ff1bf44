"""What a generation asks for (`SamplingParams`), which of its fields form the batch signature, and the ONE
builder that turns request fields plus a model's defaults into it (used by the image, edit and video routes,
`generate` and the engine's warm-up).

Field names are the diffusers pipelines' argument names (`guidance_scale`, `true_cfg_scale`,
`negative_prompt`, `num_inference_steps`, ...), so a request and a diffusers call with the same values give
the same image. No torch and no I/O here: the scheduler and the server both import this module.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from diffuserve.activation import ActivationFacts
from diffuserve.config.step_cache import StepCacheSettings
from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import SamplingDefaults
from diffuserve.family_spec.request_rules import RequestRules, validate_request
from diffuserve.family_spec.text_tokens import EncoderLimit, TokenIds


class PromptCounter(Protocol):
    """What the HTTP side may ask of a model's prompt-token owner (`pipelines.prompt_limits.PromptTokens`,
    declared here so `sampling` needs nothing from `pipelines/`)."""

    limits: Any
    """The model's text encoders and their token limits."""

    def count(self, texts: Any) -> Any:
        """One count of a request's texts: truncations and usage tokens."""

    def tokens(self, text: str) -> int:
        """Tokens of one text on the usage encoder."""


@dataclass(frozen=True)
class ControlRequest:
    """One request's ControlNet conditioning (`control_image` and its companions; docs/api.md "ControlNet").

    Per row: requests with different control images, scales, windows, ControlNets or none share a batch."""

    image: bytes
    """The encoded control image (PNG/JPEG/WebP); resized to the output size as diffusers does."""
    name: str | None = None
    """Which loaded ControlNet (`--controlnet NAME=PATH`); None: the only one loaded."""
    mode: int | None = None
    """Union ControlNets: the control type index (0 .. num_mode-1); None for single-purpose ControlNets."""
    scale: float = 1.0
    """`controlnet_conditioning_scale`: the residuals are multiplied by it."""
    start: float = 0.0
    """`control_guidance_start`: share of the steps before the ControlNet starts applying."""
    end: float = 1.0
    """`control_guidance_end`: share of the steps after which it stops applying."""


def _sig(default: Any, doc: str) -> Any:
    """A field that belongs to the batch signature (changes the tensor program)."""
    return field(default=default, metadata={"signature": True, "doc": doc})


def _row(default: Any, doc: str) -> Any:
    """A per-row field: differs freely between requests merged into one batch."""
    return field(default=default, metadata={"signature": False, "doc": doc})


@dataclass(frozen=True)
class SamplingParams:
    """Everything a generation needs. Each field says whether it is part of the batch signature.

    The signature holds exactly what changes the tensor program (shape, steps, guidance, whether CFG
    runs); prompt, negative prompt, seed, n and output encoding are per row or applied after the
    split, so requests that differ only there can share one pipeline call.
    """

    prompt: str = _row("", "Text prompt.")
    negative_prompt: str | None = _row(None, "Negative prompt; enables true CFG when true_cfg_scale > 1.")
    width: int = _sig(64, "Output width in pixels.")
    height: int = _sig(64, "Output height in pixels.")
    num_frames: int = _sig(1, "Frames for video families; 1 for images.")
    fps: int = _row(16, "Frames per second of an encoded video.")
    num_inference_steps: int = _sig(4, "Denoising steps.")
    guidance_scale: float = _sig(3.5, "Guidance (embedded guidance for FLUX.1-dev-style models).")
    true_cfg_scale: float = _sig(1.0, "Classifier-free guidance scale; CFG runs when > 1 and a negative prompt is set.")
    guidance_scale_2: float | None = _sig(None, "Second-expert guidance (Wan2.2 A14B).")
    seed: int | None = _row(None, "Random seed; None draws one at submission.")
    n: int = _row(1, "Outputs for this prompt; each owns one row of the batch.")
    output_format: str = _row("png", "png | jpeg | webp (images), mp4 (video).")
    output_quality: int = _row(90, "Encoder quality for jpeg/webp (1-100).")
    image_inputs: tuple[bytes, ...] = _row((), "Encoded input images (edits / image conditioning).")
    mask_input: bytes | None = _row(
        None,
        "Inpainting: an encoded grayscale PNG the size of the first input image, white = repaint, black = keep "
        "(diffusers' `mask_image` convention; the server and `generate` turn OpenAI's alpha masks into it, "
        "`media/masks.py`). Per row: rows with different masks, or none, share a batch. None: the whole image.",
    )
    padding_mask_crop: int | None = _row(
        None,
        "Inpainting: repaint only a crop around the mask, grown by this many pixels and resized to the output size, "
        "then pasted back over the input image (diffusers' `padding_mask_crop`); None: the whole image.",
    )
    octree_resolution: int = _sig(
        0, "Mesh families: grid cells per side of the decoded volume (0: the model's default)."
    )
    strength: float = _sig(1.0, "Image-to-image: share of the schedule re-noised from the input image (0-1].")
    lora: tuple[tuple[str, float], ...] = _row(
        (),
        "LoRA adapters as (name, scale) pairs, summed; () = the base "
        "model. Per row, so requests with different adapters share a batch.",
    )
    flow_shift: float | None = _sig(
        None,
        "The flow-matching scheduler's sigma shift in place of the checkpoint's "
        "(static; replaces dynamic shifting); None: the checkpoint's schedule.",
    )
    boundary_ratio: float | None = _sig(
        None,
        "Wan2.2 A14B: the timestep share at which the low-noise expert takes "
        "over; None: the checkpoint's model_index.json value.",
    )
    resolution: int | None = _sig(
        None, "Qwen-Image-Layered: the pipeline's resolution bucket (640 or 1024); None: the pipeline's default."
    )
    step_cache: StepCacheSettings | None = _row(
        None, "Step cache of this request's rows (None: every step computes); only its method joins the signature."
    )
    generate_audio: bool | None = _sig(
        None,
        "Joint audio-video families (LTX-2): whether the audio branch runs and the MP4 carries its sound; None: the "
        "family's default (on where it makes sound). Families without sound refuse it.",
    )
    control: ControlRequest | None = _row(
        None, "ControlNet conditioning of this request's rows (None: plain rows); per row, never in the signature."
    )
    text_ids: Mapping[str, TokenIds] | None = field(
        default=None,
        compare=False,
        repr=False,
        metadata={
            "signature": False,
            "doc": "The front end's one tokenization of the texts (tokenizer key -> ids stamped with the tokenizer "
            "that made them; `pipelines/token_ids.py`): the encode reuses them when its own tokenizer has the same "
            "stamp. None: the encode tokenizes.",
        },
    )

    @property
    def cfg_enabled(self) -> bool:
        """Whether the classifier-free-guidance branch runs (doubles the rows of the batch)."""
        return self.true_cfg_scale > 1.0 and bool(self.negative_prompt)

    @property
    def step_cache_method(self) -> str:
        """The step-cache method, or "off". The one cache setting in the batch signature (and the continuous group
        key): methods decide at different points of the denoiser call; thresholds and the rest are per row."""
        return self.step_cache.method if self.step_cache is not None else "off"

    def signature(self) -> tuple[tuple[str, Any], ...]:
        """The batch signature: equal signatures run the same tensor program. Made once per (frozen) instance:
        the scheduler compares signatures of every queued request at every scheduling pass."""
        cached = self.__dict__.get("_signature")
        if cached is None:
            items = [(f.name, getattr(self, f.name)) for f in fields(self) if f.metadata.get("signature")]
            items.append(("cfg_enabled", self.cfg_enabled))
            items.append(("step_cache_method", self.step_cache_method))
            cached = tuple(items)
            object.__setattr__(self, "_signature", cached)  # a cache, not a field: never compared or replaced
        return cached


SIZE_FIELDS = ("width", "height")
"""Signature fields that leave it for a family that packs rows of different sizes into one call."""


def row_fields(*params: SamplingParams, packs: bool = False, strength: bool = False) -> tuple[str, ...]:
    """The signature fields a loaded family takes per row for requests `params` merging: the size when it packs
    mixed sizes (`packs`, `FamilySpec.packs_mixed_sizes`), `strength` when its edits of different strengths share a
    call (`strength`, `FamilySpec.strength_per_row`) and none of them runs a step cache or a ControlNet (their
    per-row step counts and control windows follow the batch's schedule, not the row's own start)."""
    plain = all(p.step_cache is None and p.control is None for p in params)
    return (SIZE_FIELDS if packs else ()) + (("strength",) if strength and plain else ())


def signature_difference(a: SamplingParams, b: SamplingParams, free: Sequence[str] = ()) -> str | None:
    """The first signature field that differs, as `sampling_params.<field>`; None when compatible. The fields in
    `free` (the family takes them per row: `row_fields`) are not compared."""
    for (name, va), (_, vb) in zip(a.signature(), b.signature(), strict=True):
        if va != vb and name not in free:
            return f"sampling_params.{name}"
    return None


@dataclass(frozen=True)
class ModelDescription:
    """What the routes need to know about the served model, asked of the engine (never of the pipeline)."""

    family: str = "unknown"
    """Family name."""
    output_kind: str = "image"
    """image | video | mesh."""
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """Values a request gets for fields it leaves unset."""
    size_multiple: int = 1
    """Width and height must be multiples of this: the served checkpoint's figure (`Pipeline.describe_model`, from
    its family spec's size rule); 1 (no constraint) only for a description built without a pipeline."""
    max_image_inputs: int = 0
    """Input images one request may carry (0: none)."""
    min_image_inputs: int = 0
    """Input images every request must carry (edit-only models: 1)."""
    inpaints: bool = False
    """Edits may carry a `mask` (the family spec's `inpaint` task, natively)."""
    frame_multiple: int = 1
    """Video: num_frames - 1 must divide by this (the VAE's temporal compression)."""
    supports_batching: bool = True
    """Text-conditioned requests may merge."""
    packs_mixed_sizes: bool = False
    """Rows of different sizes may share one call (`FamilySpec.packs_mixed_sizes`)."""
    max_width: int | None = None
    """Largest width the checkpoint's positional tables allow (None: no limit of the model's own)."""
    max_height: int | None = None
    """Largest height the checkpoint's positional tables allow (None: no limit of the model's own)."""
    rules: RequestRules | None = None
    """The checkpoint's request rules (plain data, `family_spec.request_rules`): its `validate_request` checks a request
    against them in any process. None: a description built without a pipeline (only the builder's own checks)."""
    request_fields: frozenset[str] = frozenset()
    """Optional request fields this model gives meaning to beyond the common ones (`PEER_FIELDS`): a request that
    sets one outside this set is refused, naming the field."""
    produces_audio: bool = False
    """Its videos carry sound (`FamilySpec.produces_audio`: LTX-2): it takes `generate_audio` (and the peers'
    `generate_sound` / `sound_duration`, `AUDIO_FIELDS`); other models refuse them, naming the field."""
    activation: ActivationFacts | None = field(default=None, compare=False, repr=False)
    """What the activation-memory estimate knows about the checkpoint (`diffuserve/activation.py`); None: the
    engine admits without an estimate."""
    text_encoders: tuple[EncoderLimit, ...] = ()
    """The checkpoint's text encoders as plain data (tokenizer folder, class, limit net of the framing): the front
    end builds its own prompt counter from them (`pipelines/prompt_limits.prompt_counter`)."""
    usage_encoder: EncoderLimit | None = None
    """The encoder whose tokens are the `usage` text tokens when it is not the last of `text_encoders`."""
    prompt_tokens: PromptCounter | None = field(default=None, compare=False, repr=False)
    """This process's prompt counter (limits, truncation warnings, usage), attached by the process that uses the
    description (the HTTP front end: `server/common.served_model`), built from `text_encoders`; never sent across
    processes (the engine's description leaves it None). Its `count` tokenizes, so callers run it off the event
    loop. None: not attached."""

    @property
    def outputs(self) -> str:
        """What the model makes, in the plural (for messages): images, videos or meshes."""
        return "meshes" if self.output_kind == "mesh" else f"{self.output_kind}s"


PEER_FIELDS: dict[str, str] = {
    "flow_shift": "models whose flow-matching scheduler has a shift (natively FLUX.1, FLUX.2, SD3, SANA, Qwen-Image, "
    "Z-Image, Wan; any such scheduler through the diffusers backend)",
    "guidance_scale_2": "two-expert Wan2.2 A14B checkpoints",
    "boundary_ratio": "two-expert Wan2.2 A14B checkpoints",
    "true_cfg_scale": "families that run true CFG (FLUX.1, Qwen-Image, ...; Wan's CFG is guidance_scale)",
    "resolution": "Qwen-Image-Layered (its 640 / 1024 buckets)",
    "layers": "Qwen-Image-Layered (the number of layers, same as n)",
    "generate_audio": "joint audio-video models, whose videos carry sound (LTX-2)",
    "generate_sound": "joint audio-video models, whose videos carry sound (LTX-2)",
    "sound_duration": "joint audio-video models, whose videos carry sound (LTX-2)",
    "control_image": "models served with --controlnet (natively FLUX.1 incl. ControlNet-Union, SD3, Qwen-Image)",
}
"""Request fields of other servers' clients (SGLang-Diffusion, vLLM-Omni, FastVideo) that only some models take
-> which models, for the 400 a request gets when the served model is not one of them. (`generate_audio` is this
server's own; it sits here because only some models take it.)"""
AUDIO_FIELDS = frozenset({"generate_audio", "generate_sound", "sound_duration"})
"""The sound fields: taken by models whose `ModelDescription.produces_audio` is set, whatever `request_fields` says."""


def check_request_fields(model: ModelDescription, given: dict[str, Any]) -> None:
    """400 naming the first field of `PEER_FIELDS` that is set but means nothing to the served model."""
    takes = model.request_fields | (AUDIO_FIELDS if model.produces_audio else frozenset())
    for name, value in given.items():
        if value is not None and name in PEER_FIELDS and name not in takes:
            raise InvalidRequestError(
                f"{name} applies only to {PEER_FIELDS[name]}; the served {model.family} model does not take it. "
                f"Leave {name} out.",
                param=name,
            )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def build_sampling_params(
    model: ModelDescription,
    *,
    prompt: str,
    negative_prompt: str | None = None,
    width: int | None = None,
    height: int | None = None,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    true_cfg_scale: float | None = None,
    guidance_scale_2: float | None = None,
    num_frames: int | None = None,
    fps: int | None = None,
    seed: int | None = None,
    n: int = 1,
    output_format: str | None = None,
    output_quality: int = 90,
    image_inputs: tuple[bytes, ...] = (),
    mask_input: bytes | None = None,
    padding_mask_crop: int | None = None,
    strength: float = 1.0,
    flow_shift: float | None = None,
    boundary_ratio: float | None = None,
    resolution: int | None = None,
    lora: tuple[tuple[str, float], ...] = (),
    step_cache: StepCacheSettings | None = None,
    generate_audio: bool | None = None,
    control: ControlRequest | None = None,
) -> SamplingParams:
    """THE builder: request fields (None = unset) + the model's defaults -> checked SamplingParams.

    Unset fields take the family's defaults; an unset seed draws a random one (reported in the response so
    the result can be reproduced); images get png and videos mp4 unless a format is given; a model with sound
    makes it unless `generate_audio` is False (unset becomes True there, so both merge). Peer fields
    (`PEER_FIELDS`) the model does not take are refused, naming them. The model's own validation runs last, so every
    caller (HTTP, CLI, warm-up) refuses the same things the same way.
    """
    check_request_fields(
        model,
        {
            "guidance_scale_2": guidance_scale_2,
            "boundary_ratio": boundary_ratio,
            "flow_shift": flow_shift,
            "resolution": resolution,
            "generate_audio": generate_audio,
        },
    )
    d = model.defaults
    video = model.output_kind == "video"
    params = SamplingParams(
        prompt=prompt,
        negative_prompt=_pick(negative_prompt, d.negative_prompt),
        width=_pick(width, d.width),
        height=_pick(height, d.height),
        num_frames=_pick(num_frames, d.num_frames) if video else _pick(num_frames, 1),
        fps=_pick(fps, d.fps),
        num_inference_steps=_pick(num_inference_steps, d.num_inference_steps),
        guidance_scale=_pick(guidance_scale, d.guidance_scale),
        true_cfg_scale=_pick(true_cfg_scale, d.true_cfg_scale),
        guidance_scale_2=_pick(guidance_scale_2, d.guidance_scale_2),
        seed=seed if seed is not None else secrets.randbelow(2**31),
        n=n,
        output_format=_pick(output_format, "mp4" if video else "png"),
        output_quality=output_quality,
        image_inputs=tuple(image_inputs),
        mask_input=mask_input,
        padding_mask_crop=padding_mask_crop,
        strength=strength,
        flow_shift=flow_shift,
        boundary_ratio=boundary_ratio,
        resolution=resolution,
        lora=tuple(lora),
        step_cache=step_cache,
        generate_audio=(generate_audio is not False) if model.produces_audio else None,
        control=control,
    )
    if model.rules is not None:
        validate_request(params, model.rules, model.prompt_tokens.tokens if model.prompt_tokens else None)
    return params
