"""Qwen-Image-Edit and Qwen-Image-Edit 2509/2511 (several input images)."""

from diffuserve.family_spec.base import FamilySpec, SamplingDefaults, TextEncoderFacts
from diffuserve.family_spec.qwen_image import (
    QWEN_IMAGE_LAYERS,
    QWEN_IMAGE_QUANT_KEEP,
    QWEN_IMAGE_ROPE_POSITIONS,
    QWEN_PROFILE,
    qwen_image_geometry,
)

# diffusers' edit pipelines give the processor the whole templated prompt (no max_sequence_length cut).
EDIT_TEXT_ENCODERS = (TextEncoderFacts("processor", "text_encoder (Qwen2.5-VL)", None),)


def qwen_image_edit_max_latent_side(cfg: dict) -> int:
    """The edit adapter's size limit: a side of at most the RoPE table's positions in patches (rows and columns
    are centred, and the text positions follow from half the longest side on)."""
    return QWEN_IMAGE_ROPE_POSITIONS * int(cfg.get("patch_size") or 2)


SPECS = (
    FamilySpec(
        quant_keep=QWEN_IMAGE_QUANT_KEEP,
        name="qwen_image_edit",
        text_encoders=EDIT_TEXT_ENCODERS,
        pipeline_classes=("QwenImageEditPipeline", "QwenImageEditInpaintPipeline"),
        model_id_patterns=(r"qwen[-_]?image[-_]?edit",),
        id_priority=10,
        # Edits with a mask, as QwenImageEditInpaintPipeline (output at the image's ~1024² size; adapter.py).
        tasks=frozenset({"i2i", "inpaint"}),
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.0, true_cfg_scale=4.0, negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        native_adapter="diffuserve.families.qwen_image_edit.adapter:QwenImageEditNativePipeline",
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
        text_encoders=EDIT_TEXT_ENCODERS,
        pipeline_classes=("QwenImageEditPlusPipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_]?edit[-_]?(2509|2511|plus)",),
        id_priority=15,
        tasks=frozenset({"i2i"}),
        defaults=SamplingDefaults(num_inference_steps=40, guidance_scale=1.0, true_cfg_scale=4.0, negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        native_adapter="diffuserve.families.qwen_image_edit.adapter:QwenImageEditPlusNativePipeline",
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
