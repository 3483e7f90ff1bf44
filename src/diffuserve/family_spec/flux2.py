"""FLUX.2-dev (Mistral3 encoder) and FLUX.2-Klein 4B/9B / Klein-Base (Qwen3 encoder).

Both run natively (`families/flux2/adapter.py`), text-to-image and with reference images on /v1/images/edits (the
diffusers pipelines' `image=`); Klein also inpaints (edits with a `mask`, as Flux2KleinInpaintPipeline). Sizes are
multiples of 16 (VAE factor 8 x 2x2 patches); RoPE is computed from position ids, so no positional table limits the
size.
"""

import dataclasses
from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    GuidanceRule,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.checkpoint import square_default
from diffuserve.family_spec.flux import flux_geometry
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_strength

# The chat-formatted prompt (system message + user turn): 512 tokens, diffusers' max_sequence_length.


def flux2_defaults(
    defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry
) -> SamplingDefaults:
    """The size: the VAE's `sample_size` (1024 for the published FLUX.2 VAE, diffusers' 128 latent px x 8)."""
    return square_default(defaults, geometry, configs["vae"].get("sample_size") or 128 * geometry.vae_factor)


def klein_defaults(
    defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry
) -> SamplingDefaults:
    """The spec holds the step-distilled Klein 4B/9B's 4 steps without guidance; Klein-Base (model_index.json
    `is_distilled: false`) is sampled like diffusers' call defaults (50 steps, CFG at 4.0)."""
    defaults = flux2_defaults(defaults, configs, geometry)
    if configs.get("model_index", {}).get("is_distilled", False):
        return defaults
    return dataclasses.replace(defaults, num_inference_steps=50, guidance_scale=4.0)


_FLUX2_LAYERS = {
    "Flux2Transformer2DModel": (
        ("transformer_blocks", "num_layers"),
        ("single_transformer_blocks", "num_single_layers"),
    ),
}

# FLUX.2's embedders, timestep / guidance embedders, the shared modulation projections and the final layer stay in the
# compute dtype.
FLUX2_QUANT_KEEP = ("x_embedder", "context_embedder", "time_guidance_embed.*", "*modulation*", "norm_out.*", "proj_out")


REFERENCE_MIN_SIDE = 64
"""Smallest side of a FLUX.2 reference image (diffusers' check)."""
REFERENCE_MAX_ASPECT = 8
"""Largest aspect ratio of a FLUX.2 reference image (diffusers' check)."""


def check_flux2(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """FLUX.2 (dev and Klein): no true-CFG scale; a negative prompt only where CFG runs; readable reference images
    of a size and aspect the pipeline takes. `rules.facts["is_distilled"]`: a step-distilled Klein checkpoint."""
    klein = rules.family == "flux2_klein"
    distilled = bool(rules.facts.get("is_distilled", False))
    if params.true_cfg_scale != 1.0:
        hint = (
            "FLUX.2-Klein's classifier-free guidance scale is guidance_scale."
            if klein
            else "FLUX.2-dev is guidance-distilled: set guidance_scale (embedded guidance) instead."
        )
        raise InvalidRequestError(
            f"true_cfg_scale={params.true_cfg_scale}: {rules.family} has no true-CFG scale; {hint}",
            param="true_cfg_scale",
        )
    uses_cfg = klein and params.guidance_scale > 1.0 and not distilled
    if params.negative_prompt and not uses_cfg:
        if not klein:
            hint = "FLUX.2-dev is guidance-distilled and runs no unconditional branch; drop negative_prompt."
        elif distilled:
            hint = "this FLUX.2-Klein checkpoint is step-distilled and runs no unconditional branch."
        else:
            hint = "the unconditional branch runs only with guidance_scale > 1."
        raise InvalidRequestError(f"negative_prompt is unused here: {hint}", param="negative_prompt")
    _check_references(params, rules.family)


def _check_references(params: Any, family: str) -> None:
    import io

    from PIL import Image

    for index, data in enumerate(params.image_inputs):
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except Exception as exc:  # noqa: BLE001 - any decoder error is a bad upload
            raise InvalidRequestError(f"image {index} is not a readable image ({exc}).", param="image") from exc
        if min(width, height) < REFERENCE_MIN_SIDE:
            raise InvalidRequestError(
                f"image {index} is {width}x{height}; {family} needs reference images of at least "
                f"{REFERENCE_MIN_SIDE} px on each side.",
                param="image",
            )
        if max(width / height, height / width) > REFERENCE_MAX_ASPECT:
            raise InvalidRequestError(
                f"image {index} is {width}x{height}; {family} takes reference aspect ratios up to "
                f"{REFERENCE_MAX_ASPECT}:1.",
                param="image",
            )


def check_flux2_klein(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """FLUX.2-Klein: FLUX.2's checks, and a masked edit's strength (Flux2KleinInpaintPipeline's; reference edits
    ignore it)."""
    check_flux2(params, rules)
    if params.mask_input is not None:
        check_strength(params)


SPECS = (
    FamilySpec(
        quant_keep=FLUX2_QUANT_KEEP,
        name="flux2",
        guidance=GuidanceRule(runs_when="never"),
        request_check=check_flux2,
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Mistral3)", 512),),
        pipeline_classes=("Flux2Pipeline",),
        model_id_patterns=(r"flux\.?2",),
        id_priority=20,
        tasks=frozenset({"t2i", "i2i"}),
        native_adapter="diffuserve.families.flux2.adapter:Flux2Adapter",
        required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        lora_loader="Flux2LoraLoaderMixin",
        # diffusers' Flux2Pipeline call defaults: 50 steps, embedded guidance 4.0 (guidance-distilled: no CFG).
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=4.0),
        checkpoint_defaults=flux2_defaults,
        # Latents are 2x2-patchified into tokens, as FLUX.1's; RoPE from position ids: no table limits the size.
        latent_geometry=flux_geometry,
        # Flow-match Euler per request, per-row timestep (FLUX.2 and Klein verified row by row in a mixed group).
        supports_continuous=True,
        # Rows of different sizes share one call: per-row RoPE ids, latent padding masked (pipelines/packing.py).
        packs_mixed_sizes=True,
        text_encoder_keys=("text_encoder",),
        # The published DiT is ~32B parameters (~64 GB in bf16): resident only on a GPU with room for it.
        profile=ProfileFacts(dit_resident_threshold_gib=80.0, dit_supports_layerwise=True),
        layer_containers=_FLUX2_LAYERS,
        max_image_inputs=4,
        tiny_builds={"flux2": "diffuserve.families.flux2.tiny:build_flux2"},
    ),
    FamilySpec(
        quant_keep=FLUX2_QUANT_KEEP,
        name="flux2_klein",
        guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_one"),
        request_check=check_flux2_klein,
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Qwen3)", 512),),
        pipeline_classes=("Flux2KleinPipeline", "Flux2KleinInpaintPipeline"),
        model_id_patterns=(r"flux\.?2[-_.]?klein",),
        id_priority=30,
        # Masks natively as Flux2KleinInpaintPipeline (`families/flux2/inpaint.py`); FLUX.2-dev has no inpaint pipeline.
        tasks=frozenset({"t2i", "i2i", "inpaint"}),
        native_adapter="diffuserve.families.flux2.adapter:Flux2KleinAdapter",
        required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        lora_loader="Flux2LoraLoaderMixin",
        # The step-distilled Klein 4B/9B: 4 steps, guidance ignored. `klein_defaults` gives Klein-Base
        # (model_index.json `is_distilled: false`) diffusers' call defaults instead: 50 steps, CFG at 4.0.
        defaults=SamplingDefaults(num_inference_steps=4, guidance_scale=1.0),
        checkpoint_defaults=klein_defaults,
        latent_geometry=flux_geometry,
        supports_continuous=True,
        # Rows of different sizes share one call: per-row RoPE ids, latent padding masked (pipelines/packing.py).
        packs_mixed_sizes=True,
        text_encoder_keys=("text_encoder",),
        profile=ProfileFacts(dit_resident_threshold_gib=24.0, dit_supports_layerwise=True),
        layer_containers=_FLUX2_LAYERS,
        max_image_inputs=4,
        tiny_builds={"flux2-klein": "diffuserve.families.flux2.tiny:build_flux2_klein"},
        base_family="flux2",
    ),
)
