"""What a request is checked against: a checkpoint's request rules as plain data (`RequestRules`), and the checks the
family specs share (frame counts, edit strength, ControlNet fields).

The rules are derived once in the engine process (`Pipeline.request_rules`, from the checkpoint's facts) and travel
with the model's description (`sampling.ModelDescription.rules`), so any process checks a request with the pure
function `validate_request` below and no model object. A family's own checks are one pure function registered in
its spec (`FamilySpec.request_check`), reading only the request and these rules. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diffuserve.errors import InvalidRequestError

TokenCount = Callable[[str], int]
"""Tokens of one text on the model's usage encoder (the front end's prompt counter), for checks that bound a
prompt by a model's positions (Qwen-Image 2.1)."""


@dataclass(frozen=True)
class RequestRules:
    """The facts a request is checked against, for one loaded checkpoint: plain data, so it crosses processes."""

    family: str
    """Family name (its spec's `request_check` runs after the common checks)."""
    output_kind: str = "image"
    """image | video | mesh."""
    backend: str = "native"
    """native | diffusers: the diffusers backend's own checks (`diffusers_checks`) replace the family's."""
    size_multiple: int = 1
    """Width and height must be positive multiples of this."""
    max_width: int | None = None
    """Largest width the checkpoint's positional tables allow (None: no limit of the model's own)."""
    max_height: int | None = None
    """Largest height the checkpoint's positional tables allow (None: no limit of the model's own)."""
    max_pixels: int = 4096 * 4096
    """Largest width x height."""
    max_image_inputs: int = 0
    """Input images one request may carry."""
    min_image_inputs: int = 0
    """Input images every request must carry."""
    inpaints: bool = False
    """Edits may carry a mask."""
    frame_multiple: int = 1
    """Video: num_frames - 1 must divide by this (the VAE's time compression)."""
    step_cache_problems: Mapping[str, str] = field(default_factory=dict)
    """Step-cache method -> why this checkpoint cannot run it (a method not listed runs)."""
    facts: Mapping[str, Any] = field(default_factory=dict)
    """The family's own facts its check reads (its ControlNets, whether it has two experts, ...), plain data."""


FamilyCheck = Callable[[Any, RequestRules, "TokenCount | None"], None]
"""A family's own request checks: (params, rules, prompt token counter or None) -> None, or InvalidRequestError
naming the field. Runs after the common checks (`validate_request`)."""


def check_frame_count(num_frames: int, step: int, *, model: str, vae: str = "VAE") -> None:
    """400 naming `num_frames` unless it is k x `step` + 1 (the VAE's time compression), with the two nearest
    counts that fit. `model` and `vae` name the checkpoint and its video VAE in the message."""
    if num_frames < 1 or (num_frames - 1) % step:
        below = max(1, (num_frames - 1) // step * step + 1)
        raise InvalidRequestError(
            f"num_frames={num_frames} does not fit this {model} checkpoint: it needs {step}k+1 frames (its {vae} "
            f"compresses time {step}x); use {below} or {below + step}.",
            param="num_frames",
        )


def check_strength(params: Any) -> None:
    """An edit's `strength` in (0, 1] that leaves at least one denoising step (the diffusers pipelines' check)."""
    if not params.image_inputs:
        return
    if not 0.0 < params.strength <= 1.0:
        raise InvalidRequestError(f"strength={params.strength} must be in (0, 1].", param="strength")
    if int(params.num_inference_steps * params.strength) < 1:
        raise InvalidRequestError(
            f"strength={params.strength} with num_inference_steps={params.num_inference_steps} leaves no denoising "
            "step; raise strength or num_inference_steps.",
            param="strength",
        )


def check_one_image(params: Any, message: str) -> None:
    """Image-to-video: exactly one input image (`input_reference`)."""
    if len(params.image_inputs) != 1:
        raise InvalidRequestError(message, param="input_reference")


CONTROL_SCALE_RANGE = (0.0, 10.0)
"""`controlnet_conditioning_scale` bounds (`pipelines/controlnet.SCALE_RANGE` reads this)."""


def control_name(params: Any, controlnets: Mapping[str, int | None]) -> str:
    """The loaded ControlNet a request's rows use (its `controlnet` name, or the only one loaded)."""
    control = params.control
    if not controlnets:
        raise InvalidRequestError(
            "control_image: no ControlNet is loaded; serve with --controlnet [NAME=]PATH.", param="control_image"
        )
    names = ", ".join(controlnets)
    if control.name is None:
        if len(controlnets) > 1:
            raise InvalidRequestError(
                f"controlnet: several ControlNets are loaded ({names}); name the one to use.", param="controlnet"
            )
        return next(iter(controlnets))
    if control.name not in controlnets:
        raise InvalidRequestError(
            f"controlnet: no ControlNet named {control.name!r} (loaded: {names}).", param="controlnet"
        )
    return str(control.name)


def check_control(params: Any, rules: RequestRules) -> None:
    """400 naming the field for a request's ControlNet fields this server cannot run; `rules.facts["controlnets"]`
    maps each loaded ControlNet's name to its Union mode count (None: not a Union ControlNet)."""
    control = params.control
    if control is None:
        return
    controlnets: Mapping[str, int | None] = rules.facts.get("controlnets", {})
    name = control_name(params, controlnets)
    modes = controlnets[name]
    if modes is None and control.mode is not None:
        raise InvalidRequestError(
            f"control_mode: ControlNet {name!r} is not a Union ControlNet (no modes); leave control_mode out.",
            param="control_mode",
        )
    if modes is not None and (control.mode is None or not 0 <= control.mode < modes):
        got = "is missing" if control.mode is None else f"{control.mode} is not one of its modes"
        raise InvalidRequestError(
            f"control_mode {got}: Union ControlNet {name!r} takes a mode 0..{modes - 1} (the control type, e.g. "
            "for InstantX's FLUX.1 Union: 0 canny, 1 tile, 2 depth, 3 blur, 4 pose, 5 gray, 6 low quality).",
            param="control_mode",
        )
    low, high = CONTROL_SCALE_RANGE
    if not low <= control.scale <= high:
        raise InvalidRequestError(
            f"controlnet_conditioning_scale={control.scale} must be in [{low}, {high}].",
            param="controlnet_conditioning_scale",
        )
    if not 0.0 <= control.start < control.end <= 1.0:
        raise InvalidRequestError(
            f"control_guidance_start={control.start}, control_guidance_end={control.end}: need "
            "0 <= start < end <= 1 (shares of the steps).",
            param="control_guidance_start" if not 0.0 <= control.start < 1.0 else "control_guidance_end",
        )
    if params.image_inputs:
        raise InvalidRequestError(
            "control_image: ControlNet runs on text-to-image (POST /v1/images/generations); an edit takes none.",
            param="control_image",
        )
    if params.step_cache_method != "off":
        raise InvalidRequestError(
            f"step_cache: a step cache ({params.step_cache_method}) skips the DiT blocks that take the ControlNet's "
            'residuals, so it is refused for ControlNet rows; send "step_cache": "off" with control_image.',
            param="step_cache",
        )


def no_crop(params: Any, pipeline: str) -> None:
    """Refuse `padding_mask_crop` for a family whose diffusers pipeline has no crop (`pipeline` names it)."""
    if params.padding_mask_crop is not None:
        raise InvalidRequestError(f"padding_mask_crop: {pipeline}; leave it out.", param="padding_mask_crop")


def diffusers_checks(params: Any, rules: RequestRules, common: Callable[[Any, RequestRules], None]) -> None:
    """The diffusers backend's checks around the `common` ones: a boundary inside (0, 1); a layered pipeline's
    resolution buckets (`rules.facts["resolutions"]`) and its one input image (`rules.facts["layered"]`); a video
    pipeline's frame count."""
    if params.boundary_ratio is not None and not 0.0 < params.boundary_ratio < 1.0:
        raise InvalidRequestError(
            f"boundary_ratio={params.boundary_ratio} must be between 0 and 1 (exclusive).", param="boundary_ratio"
        )
    buckets = tuple(rules.facts.get("resolutions", ()))
    if params.resolution is not None and params.resolution not in buckets:
        raise InvalidRequestError(
            f"resolution={params.resolution} is not one of this {rules.family} model's buckets {list(buckets)}.",
            param="resolution",
        )
    if rules.output_kind == "video":
        frames, step = params.num_frames, rules.frame_multiple
        if frames < 1 or (frames - 1) % step:
            below = max(1, (frames - 1) // step * step + 1)
            raise InvalidRequestError(
                f"num_frames={frames} does not fit this {rules.family} model, which needs num_frames = "
                f"{step}k+1 (its VAE compresses time {step}x); use {below} or {below + step}.",
                param="num_frames",
            )
    # max_image_inputs stays 0 unless the pipeline's call takes `image`: an unmodified text-to-image pipeline would
    # ignore an image, so the common check refuses edits rather than silently answering one with an unrelated
    # generation.
    common(params, rules)
    if len(params.image_inputs) < rules.min_image_inputs:
        raise InvalidRequestError(
            f"this {rules.family} model splits one input image into layers: send it with POST /v1/images/edits "
            f"(one `image` file; `n` = number of layers); got {len(params.image_inputs)}.",
            param="image",
        )


# -- the check: one pure function of the request and the rules ----------------------------------------------


def mask_refusal(family: str) -> InvalidRequestError:
    """The 400 of a `mask` sent to a model that does not inpaint, naming the families that do (their spec's
    `inpaint` task)."""
    from diffuserve.family_spec import families_with, named_list

    return InvalidRequestError(
        f"mask: this {family} model does not inpaint; masks are taken natively by "
        f"{named_list(families_with('inpaints'))}. Leave mask out to edit the whole image.",
        param="mask",
    )


def validate_request(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """Refuse what the checkpoint cannot run, naming the field (InvalidRequestError): a pure function of the request
    and the checkpoint's rules, so the HTTP front end, `generate` and the engine refuse the same way. The common
    checks, then the family's own (`FamilySpec.request_check`; the diffusers backend's `diffusers_checks`, which
    run the common ones themselves). `tokens`: the prompt counter for checks that bound a prompt's tokens."""
    from diffuserve.family_spec import spec_for

    if rules.backend == "diffusers":
        diffusers_checks(params, rules, common_checks)
        return
    try:
        check = spec_for(rules.family).request_check
    except KeyError:
        check = None
    if not rules.facts.get("replaces_common_checks", False):
        common_checks(params, rules)
    if check is not None:
        check(params, rules, tokens)


def common_checks(params: Any, rules: RequestRules) -> None:
    """What every model refuses: sizes off its multiple or past its tables, too many input images, a mask it cannot
    take, too many pixels, frames for an image model, a step cache it cannot run."""
    for name in ("width", "height"):
        value, step = getattr(params, name), rules.size_multiple
        if value <= 0 or value % step:
            raise InvalidRequestError(
                f"{name}={value} is not a positive multiple of {step}, which this {rules.family} model needs; "
                f"choose e.g. {max(step, value // step * step)}.",
                param="size",
            )
    for name, value, limit in (("width", params.width, rules.max_width), ("height", params.height, rules.max_height)):
        if limit is not None and value > limit:
            raise InvalidRequestError(
                f"{name}={value} is larger than this {rules.family} checkpoint can run (its positional tables "
                f"end at {limit} px); choose a size up to {rules.max_width}x{rules.max_height}.",
                param="size",
            )
    if len(params.image_inputs) > rules.max_image_inputs:
        what = (
            "takes no input image (image inputs / edits are not supported for it)"
            if not rules.max_image_inputs
            else f"takes at most {rules.max_image_inputs} input image(s)"
        )
        # The video API calls its image field `input_reference`; the images API `image`.
        raise InvalidRequestError(
            f"this {rules.family} model {what}; got {len(params.image_inputs)}.",
            param="input_reference" if rules.output_kind == "video" else "image",
        )
    _check_mask(params, rules)
    if params.width * params.height > rules.max_pixels:
        raise InvalidRequestError(
            f"size {params.width}x{params.height} exceeds this server's limit of {rules.max_pixels} pixels.",
            param="size",
        )
    if rules.output_kind == "image" and params.num_frames != 1:
        raise InvalidRequestError("num_frames must be 1 for an image model.", param="num_frames")
    _check_step_cache(params, rules)


def _check_mask(params: Any, rules: RequestRules) -> None:
    """A mask only where the family inpaints, only with an input image; `padding_mask_crop` only with a mask."""
    if params.mask_input is not None and not rules.inpaints:
        raise mask_refusal(rules.family)
    if params.mask_input is not None and not params.image_inputs:
        raise InvalidRequestError("mask needs the image it masks; send an `image` file too.", param="mask")
    if params.padding_mask_crop is not None and (params.mask_input is None or params.padding_mask_crop < 0):
        raise InvalidRequestError(
            f"padding_mask_crop={params.padding_mask_crop} needs a mask and a value >= 0 (pixels around it).",
            param="padding_mask_crop",
        )


def _check_step_cache(params: Any, rules: RequestRules) -> None:
    settings = params.step_cache
    if settings is None:
        return
    problem = rules.step_cache_problems.get(settings.method)
    if problem is not None:
        raise InvalidRequestError(
            f"step_cache {settings.method!r} cannot run on this {rules.family} model: {problem}.", param="step_cache"
        )
    if settings.method == "magcache" and not settings.mag_ratios and not settings.calibrate:
        raise InvalidRequestError(
            "step_cache magcache needs this checkpoint's magnitude ratios (`diffuserve "
            "calibrate-cache`, then --step-cache-calibration FILE).",
            param="step_cache",
        )
