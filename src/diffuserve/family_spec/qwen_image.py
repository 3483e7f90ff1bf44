"""Qwen-Image (and 2512): Qwen2.5-VL text, MM-DiT, norm-rescaled true CFG; Qwen-Image 2.1: Qwen3-VL text,
single-stream block-causal DiT with a prefix KV cache."""

import dataclasses
from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_control, check_strength

# Qwen-Image: the prompt inside its template, system prefix dropped, cut to max_sequence_length (512) tokens.
# 2.1 reads the whole prompt through its processor's tokenizer, as far as the RoPE table's non-negative
# positions go (a longer one is refused by the adapter's validate, naming the field).

QWEN_IMAGE_LAYERS = {"QwenImageTransformer2DModel": (("transformer_blocks", "num_layers"),)}
"""The Qwen-Image DiT's repeated blocks (shared with the edit families)."""

# Qwen-Image runs true CFG; FSDP was not measured faster there, so auto keeps the non-FSDP path.
QWEN_PROFILE = ProfileFacts(
    default_uses_cfg=True, dit_supports_layerwise=True, sequence_parallel=True, tensor_parallel=True
)

QWEN_IMAGE_ROPE_POSITIONS = 4096
"""Positions in diffusers' `QwenEmbedRope` tables (fixed in the class, not in config.json)."""
QWEN_IMAGE_TEXT_TOKENS = 512
"""Text tokens the transformer reads at most (diffusers' `max_sequence_length` default)."""
QWEN_IMAGE_21_ROPE_POSITIONS = (8192, 1024)
"""Non-negative and negative positions in diffusers' `QwenImage21Rope` tables (fixed in the class)."""


def qwen_image_max_latent_side(cfg: dict) -> int:
    """Rows/columns of n tokens sit centred (-(n - n//2) .. n//2 - 1) and the text starts max(h, w) // 2
    positions in, so n // 2 + 512 text tokens must fit the table: n <= 2 * (4096 - 512) tokens."""
    return 2 * (QWEN_IMAGE_ROPE_POSITIONS - QWEN_IMAGE_TEXT_TOKENS) * int(cfg.get("patch_size") or 2)


def qwen_image_21_max_latent_side(cfg: dict) -> int:
    """2.1 centres an image's rows/columns on its own tables: n - n//2 <= 1024 negative, n//2 <= 8192."""
    positive, negative = QWEN_IMAGE_21_ROPE_POSITIONS
    return min(2 * negative, 2 * positive) * int(cfg.get("patch_size") or 1)


def qwen_image_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """The Qwen-Image VAE halves the side at each temporal-downsample level (diffusers' `2 **
    len(vae.temperal_downsample)`: 8), then 2x2 latent patches per token."""
    levels = configs["vae"].get("temperal_downsample") or (False, True, True)
    return LatentGeometry(vae_factor=2 ** len(levels), patch=2)


def qwen_image_21_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """2.1's VAE is 16x (a constant of diffusers' QwenImage21Pipeline), and each encoder image slot stands for 2x2
    latent tokens."""
    return LatentGeometry(vae_factor=16, patch=2)


def qwen_image_21_defaults(
    defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry
) -> SamplingDefaults:
    """A Turbo checkpoint carries its sampling grid in model_index.json (`sample_sigmas`): its length is the step
    count."""
    sigmas = configs.get("model_index", {}).get("sample_sigmas")
    return dataclasses.replace(defaults, num_inference_steps=len(sigmas)) if sigmas else defaults


# Qwen-Image's input projections, timestep embedder and the final layer stay in the compute dtype; the per-block
# modulation (`img_mod.1` / `txt_mod.1`, a third of each block's weights) is quantized with per-row scales, as FLUX.1's.
QWEN_IMAGE_QUANT_KEEP = ("img_in", "txt_in", "time_text_embed.*", "norm_out.*", "proj_out")


def check_qwen_image(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """Qwen-Image: its ControlNet fields; an input image only with a mask (diffusers has no Qwen-Image img2img
    pipeline we follow), and the strength."""
    check_control(params, rules)
    if params.image_inputs and params.mask_input is None:
        raise InvalidRequestError(
            "Qwen-Image takes an input image only to inpaint it: send a mask with the image (Qwen-Image-Edit "
            "checkpoints edit whole images).",
            param="mask",
        )
    check_strength(params)


def check_qwen_image_21(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """Qwen-Image 2.1 reads the whole prompt (no max_sequence_length) and numbers text tokens on the RoPE frame
    axis before the image: past the table's non-negative positions they would silently wrap. Counted on the
    templated text (`rules.facts`: `prompt_template`, `drop_idx`) with the caller's prompt counter. A Turbo
    checkpoint samples on its own grid (`rules.facts["grid_steps"]`), which fixes the step count."""
    limit = QWEN_IMAGE_21_ROPE_POSITIONS[0] - 1
    template, drop = rules.facts.get("prompt_template"), int(rules.facts.get("drop_idx", 0))
    for name, text in (("prompt", params.prompt), ("negative_prompt", params.negative_prompt)):
        # A cheap pre-check first: a token covers at most a few characters.
        if tokens is not None and template is not None and text and len(text) > limit // 8:
            count = tokens(template.format(text)) - drop
            if count > limit:
                raise InvalidRequestError(
                    f"{name} is {count} tokens long; Qwen-Image 2.1 positions at most {limit} text tokens. Shorten it.",
                    param=name,
                )
    grid = rules.facts.get("grid_steps")
    if grid and params.num_inference_steps != grid:
        raise InvalidRequestError(
            f"this Qwen-Image 2.1 Turbo checkpoint samples on its own {grid}-step grid "
            f"(model_index.json sample_sigmas); num_inference_steps={params.num_inference_steps} cannot "
            f"run, use {grid} or leave it unset.",
            param="num_inference_steps",
        )


SPECS = (
    FamilySpec(
        quant_keep=QWEN_IMAGE_QUANT_KEEP,
        name="qwen_image",
        peer_fields=frozenset({"true_cfg_scale"}),
        request_check=check_qwen_image,
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Qwen2.5-VL)", QWEN_IMAGE_TEXT_TOKENS),),
        pipeline_classes=("QwenImagePipeline", "QwenImageInpaintPipeline"),
        # Edits with a mask, as QwenImageInpaintPipeline (pipelines/inpaint.py); an image without a mask is refused.
        max_image_inputs=1,
        tasks=frozenset({"t2i", "inpaint"}),
        strength_per_row=True,  # each edit row starts at its own step of the shared schedule (pipelines/inpaint.py)
        model_id_patterns=(r"qwen[-_]?image",),
        id_priority=0,
        native_adapter="diffuserve.families.qwen_image.adapter:QwenImageAdapter",
        required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        lora_loader="QwenImageLoraLoaderMixin",
        controlnet_classes=("QwenImageControlNetModel",),
        # diffusers' call defaults (1024x1024 from default_sample_size 128 x VAE 8, 50 steps, true_cfg_scale 4),
        # with the negative prompt " " of Qwen's own example: diffusers' None would leave true_cfg_scale without
        # effect, and Qwen-Image is a CFG workload. A diffusers call with negative_prompt=" " gives the same image.
        defaults=SamplingDefaults(
            width=1024, height=1024, num_inference_steps=50, guidance_scale=1.0, true_cfg_scale=4.0, negative_prompt=" "
        ),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        latent_geometry=qwen_image_geometry,
        max_latent_side=qwen_image_max_latent_side,
        # Flow-match per request; masked text rows are padded per step like a merged batch (verified row by row).
        supports_continuous=True,
        # Rows of different sizes share one call: per-row RoPE tables, image padding masked (pipelines/packing.py).
        packs_mixed_sizes=True,
        text_encoder_keys=("text_encoder",),
        tiny_builds={"qwen-image": "diffuserve.families.qwen_image.tiny:build_qwen_image"},
    ),
    FamilySpec(
        quant_keep=QWEN_IMAGE_QUANT_KEEP,
        name="qwen_image_21",
        peer_fields=frozenset({"true_cfg_scale"}),
        request_check=check_qwen_image_21,
        text_encoders=(TextEncoderFacts("processor", "text_encoder (Qwen3-VL)", QWEN_IMAGE_21_ROPE_POSITIONS[0] - 1),),
        pipeline_classes=("QwenImage21Pipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_.]?2\.?1",),
        id_priority=5,
        native_adapter="diffuserve.families.qwen_image.adapter:QwenImage21Adapter",
        required_components=("transformer", "vae", "text_encoder", "processor", "scheduler"),
        lora_loader="QwenImageLoraLoaderMixin",
        # diffusers' call defaults: output_resolution 1024, 40 steps, true_cfg_scale 1 (2.1 samples without
        # guidance); a Turbo checkpoint's `sample_sigmas` fixes the step count instead (the adapter reads it).
        defaults=SamplingDefaults(
            width=1024,
            height=1024,
            num_inference_steps=40,
            guidance_scale=1.0,
            true_cfg_scale=1.0,
            negative_prompt=None,
        ),
        profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True),
        layer_containers={"QwenImage21Transformer2DModel": (("transformer_blocks", "num_layers"),)},
        checkpoint_defaults=qwen_image_21_defaults,
        latent_geometry=qwen_image_21_geometry,
        max_latent_side=qwen_image_21_max_latent_side,
        supports_continuous=True,
        # Cannot pack sizes: its block-causal DiT reuses a prefix KV cache kept per text length and image layout,
        # which rows of other sizes would not share; size-grouped batches.
        packs_mixed_sizes=False,
        text_encoder_keys=("text_encoder",),
        tiny_builds={"qwen-image-2.1": "diffuserve.families.qwen_image.tiny:build_qwen_image_21"},
        base_family="qwen_image",
    ),
)
