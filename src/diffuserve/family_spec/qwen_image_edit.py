"""Qwen-Image-Edit and Qwen-Image-Edit 2509/2511 (several input images)."""

import math
from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import FamilySpec, GuidanceRule, SamplingDefaults, TextEncoderFacts
from diffuserve.family_spec.qwen_image import (
    QWEN_IMAGE_LAYERS,
    QWEN_IMAGE_QUANT_KEEP,
    QWEN_IMAGE_ROPE_POSITIONS,
    QWEN_PROFILE,
    qwen_image_geometry,
)
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_strength

# diffusers' edit pipelines give the processor the whole templated prompt (no max_sequence_length cut).
EDIT_TEXT_ENCODERS = (TextEncoderFacts("processor", "text_encoder (Qwen2.5-VL)", None),)


def qwen_image_edit_max_latent_side(cfg: dict) -> int:
    """The edit adapter's size limit: a side of at most the RoPE table's positions in patches (rows and columns
    are centred, and the text positions follow from half the longest side on)."""
    return QWEN_IMAGE_ROPE_POSITIONS * int(cfg.get("patch_size") or 2)


EDIT_AREA = 1024 * 1024
"""The pixel area a masked Qwen-Image-Edit output is sized to (QwenImageEditInpaintPipeline)."""


def edit_size(width: int, height: int) -> tuple[int, int]:
    """The output size QwenImageEditInpaintPipeline gives an input image of `width` x `height` (diffusers'
    `calculate_dimensions(1024 * 1024, ratio)`: the ratio kept at ~1024² px, each side a multiple of 32)."""
    ratio = width / height
    out_width = math.sqrt(EDIT_AREA * ratio)
    out_height = out_width / ratio
    return round(out_width / 32) * 32, round(out_height / 32) * 32


def check_qwen_image_edit(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """An edit needs its input image; a masked edit's strength, and its size (QwenImageEditInpaintPipeline outputs
    the image's ~1024² size)."""
    if len(params.image_inputs) < rules.min_image_inputs:
        raise InvalidRequestError(
            f"this {rules.family} model edits images: send the input image with POST /v1/images/edits "
            f"(up to {rules.max_image_inputs} `image` file(s)); got {len(params.image_inputs)}.",
            param="image",
        )
    if params.mask_input is None:
        return
    import io

    from PIL import Image

    check_strength(params)
    image = Image.open(io.BytesIO(params.image_inputs[0]))
    width, height = edit_size(*image.size)
    if (params.width, params.height) != (width, height):
        raise InvalidRequestError(
            f"a masked {rules.family} edit is output at its image's ~1024x1024 size, {width}x{height} for this "
            f"{image.size[0]}x{image.size[1]} image (as QwenImageEditInpaintPipeline sizes it); send "
            f"size={width}x{height}, not {params.width}x{params.height}.",
            param="size",
        )


SPECS = (
    FamilySpec(
        quant_keep=QWEN_IMAGE_QUANT_KEEP,
        name="qwen_image_edit",
        guidance=GuidanceRule(runs_when="true_cfg_given_negative"),
        request_check=check_qwen_image_edit,
        text_encoders=EDIT_TEXT_ENCODERS,
        pipeline_classes=("QwenImageEditPipeline", "QwenImageEditInpaintPipeline"),
        model_id_patterns=(r"qwen[-_]?image[-_]?edit",),
        id_priority=10,
        # Edits with a mask, as QwenImageEditInpaintPipeline (output at the image's ~1024² size; adapter.py).
        tasks=frozenset({"i2i", "inpaint"}),
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.0, true_cfg_scale=4.0, negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        native_adapter="diffuserve.families.qwen_image_edit.adapter:QwenImageEditAdapter",
        required_components=("transformer", "vae", "text_encoder", "processor", "scheduler"),
        lora_loader="QwenImageLoraLoaderMixin",
        latent_geometry=qwen_image_geometry,
        max_latent_side=qwen_image_edit_max_latent_side,
        # Image-conditioned: not continuous (its edits run as request-level batches under `continuous`).
        text_encoder_keys=("text_encoder",),
        max_image_inputs=1,
        supports_batching=False,
        # No packing: its requests never share a call (each edit's input-image tokens and prompt template are its own).
        packs_mixed_sizes=False,
        tiny_builds={"qwen-image-edit": "diffuserve.families.qwen_image_edit.tiny:build_edit"},
        base_family="qwen_image",
    ),
    FamilySpec(
        quant_keep=QWEN_IMAGE_QUANT_KEEP,
        name="qwen_image_edit_plus",
        guidance=GuidanceRule(runs_when="true_cfg_given_negative"),
        request_check=check_qwen_image_edit,
        text_encoders=EDIT_TEXT_ENCODERS,
        pipeline_classes=("QwenImageEditPlusPipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_]?edit[-_]?(2509|2511|plus)",),
        id_priority=15,
        tasks=frozenset({"i2i"}),
        defaults=SamplingDefaults(num_inference_steps=40, guidance_scale=1.0, true_cfg_scale=4.0, negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        native_adapter="diffuserve.families.qwen_image_edit.adapter:QwenImageEditPlusAdapter",
        required_components=("transformer", "vae", "text_encoder", "processor", "scheduler"),
        lora_loader="QwenImageLoraLoaderMixin",
        latent_geometry=qwen_image_geometry,
        max_latent_side=qwen_image_edit_max_latent_side,
        text_encoder_keys=("text_encoder",),
        # The 2509/2511 model cards: multi-image editing works best with 1 to 3 input images.
        max_image_inputs=3,
        supports_batching=False,
        # No packing: its requests never share a call (each edit's input-image tokens and prompt template are its own).
        packs_mixed_sizes=False,
        tiny_builds={"qwen-image-edit-plus": "diffuserve.families.qwen_image_edit.tiny:build_edit_plus"},
        base_family="qwen_image",
    ),
)
