"""FLUX.1 (dev, schnell) and FLUX.1 Kontext."""

import dataclasses
from typing import Any

from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    StepCacheRules,
    TextEncoderFacts,
)
from diffuserve.family_spec.checkpoint import square_default
from diffuserve.family_spec.components import autoencoder_kl_factor
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_control, check_strength, no_crop

# CLIP's 77 tokens (pooled), then T5: diffusers' max_sequence_length 512 (capped by what tokenizer_2 declares).
FLUX_TEXT_ENCODERS = (
    TextEncoderFacts("tokenizer", "text_encoder (CLIP)", 77),
    TextEncoderFacts("tokenizer_2", "text_encoder_2 (T5)", 512),
)


def flux_modulated_input(block: Any, hidden: Any, arguments: dict[str, Any]) -> Any:
    """TeaCache's input on FLUX.1: the first double block's `norm1` of the hidden states with the step's `temb`."""
    return block.norm1(hidden, emb=arguments["temb"])[0]


FLUX_STEP_CACHE = {
    "FluxTransformer2DModel": StepCacheRules(
        chained=True,
        # TeaCache4FLUX (ali-vilab/TeaCache): the rescale polynomial fitted on FLUX.1-dev, highest power first.
        teacache_coefficients=(4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01),
        teacache_input=flux_modulated_input,
    ),
}


def flux_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """FLUX packs 2x2 latent patches into tokens: sizes divide by the VAE factor times 2."""
    return LatentGeometry(vae_factor=autoencoder_kl_factor(configs["vae"]), patch=2)


def flux_defaults(defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry) -> SamplingDefaults:
    """The size: the VAE's `sample_size` is the training resolution in pixels (1024 for FLUX.1, which is also
    diffusers' 128 latent px x 8); a tiny checkpoint's is its small native size instead of an expensive 1024.
    The variant: dev (guidance-distilled, embedded guidance) keeps the spec's 28 steps at 3.5; schnell (its
    transformer has no guidance embedding) samples 4 steps without guidance."""
    defaults = square_default(defaults, geometry, configs["vae"].get("sample_size") or 128 * geometry.vae_factor)
    if configs.get("transformer", {}).get("guidance_embeds", False):
        return defaults
    return dataclasses.replace(defaults, num_inference_steps=4, guidance_scale=0.0)


# FLUX.1's input and context embedders, timestep / guidance / pooled-text embedders and the final layer (AdaLN and
# projection) stay in the compute dtype. The per-block AdaLN projections (`norm1.linear`, `norm.linear`) are quantized
# with per-row scales: they hold ~27% of the DiT's weights, and keeping them would leave an fp8 DiT at 0.64x of bf16.
FLUX_QUANT_KEEP = ("x_embedder", "context_embedder", "time_text_embed.*", "norm_out.*", "proj_out")

FLUX_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
"""The native adapter's components (model_index.json keys)."""


def check_flux(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """FLUX.1: its ControlNet fields; an image-to-image edit's strength."""
    check_control(params, rules)
    check_strength(params)


def check_flux_fill(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """FLUX.1 Fill: no crop (diffusers' FluxFillPipeline repaints the whole image it is given)."""
    check_flux(params, rules)
    no_crop(params, "FLUX.1 Fill repaints the whole image it is given (diffusers' FluxFillPipeline has no crop)")


SPECS = (
    FamilySpec(
        quant_keep=FLUX_QUANT_KEEP,
        name="flux",
        peer_fields=frozenset({"true_cfg_scale"}),
        request_check=check_flux,
        text_encoders=FLUX_TEXT_ENCODERS,
        pipeline_classes=("FluxPipeline", "FluxImg2ImgPipeline"),
        model_id_patterns=(r"flux",),
        id_priority=0,
        tasks=frozenset({"t2i", "i2i", "inpaint"}),
        strength_per_row=True,  # each edit row starts at its own step of the shared schedule (pipelines/inpaint.py)
        native_adapter="diffuserve.families.flux.adapter:FluxAdapter",
        required_components=FLUX_COMPONENTS,
        lora_loader="FluxLoraLoaderMixin",
        # FLUX.1 ControlNet and ControlNet-Union (InstantX, Shakker-Labs) share this class (`num_mode` for Union).
        controlnet_classes=("FluxControlNetModel",),
        # FLUX.1-dev: guidance-distilled (embedded guidance 3.5), 28 steps at 1024^2; `flux_defaults` switches
        # to schnell's 4 steps without guidance when the transformer has no guidance embedding.
        defaults=SamplingDefaults(width=1024, height=1024, num_inference_steps=28, guidance_scale=3.5),
        checkpoint_defaults=flux_defaults,
        # One branch per step by default; the native adapter streams double and single blocks.
        profile=ProfileFacts(
            default_uses_cfg=False, dit_supports_layerwise=True, sequence_parallel=True, tensor_parallel=True
        ),
        layer_containers={
            "FluxTransformer2DModel": (
                ("transformer_blocks", "num_layers"),
                ("single_transformer_blocks", "num_single_layers"),
            ),
        },
        step_cache_rules=FLUX_STEP_CACHE,
        latent_geometry=flux_geometry,
        # FlowMatchEulerDiscreteScheduler steps from the row's own sigma[i], sigma[i+1]; the transformer takes a
        # per-row timestep; position ids and the guidance vector depend only on size and guidance (the group key).
        supports_continuous=True,
        # Rows of different sizes share one call: padded per row, masked, per-row RoPE (pipelines/packing.py).
        packs_mixed_sizes=True,
        text_encoder_keys=("text_encoder", "text_encoder_2"),
        max_image_inputs=1,
        tiny_builds={"flux": "diffuserve.families.flux.tiny:build_flux"},
    ),
    FamilySpec(
        quant_keep=FLUX_QUANT_KEEP,
        name="flux_fill",
        peer_fields=frozenset({"true_cfg_scale"}),
        request_check=check_flux_fill,
        text_encoders=FLUX_TEXT_ENCODERS,
        pipeline_classes=("FluxFillPipeline",),
        model_id_patterns=(r"flux\.?1?[-_.]?fill",),
        id_priority=10,
        # Edits only: an image, and a mask (none: the whole image), as FluxFillPipeline (families/flux/adapter.py).
        tasks=frozenset({"i2i", "inpaint"}),
        strength_per_row=True,
        native_adapter="diffuserve.families.flux.adapter:FluxFillAdapter",
        required_components=FLUX_COMPONENTS,
        # FLUX.1-Fill-dev: 50 steps at embedded guidance 30 (diffusers' FluxFillPipeline call defaults).
        defaults=SamplingDefaults(width=1024, height=1024, num_inference_steps=50, guidance_scale=30.0),
        checkpoint_defaults=flux_defaults,
        profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True),
        latent_geometry=flux_geometry,
        text_encoder_keys=("text_encoder", "text_encoder_2"),
        max_image_inputs=1,
        base_family="flux",
        tiny_builds={"flux-fill": "diffuserve.families.flux.tiny:build_flux_fill"},
    ),
    FamilySpec(
        quant_keep=FLUX_QUANT_KEEP,
        name="flux_kontext",
        text_encoders=FLUX_TEXT_ENCODERS,
        pipeline_classes=("FluxKontextPipeline",),
        model_id_patterns=(r"flux\.?1?[-_.]?kontext",),
        id_priority=10,
        tasks=frozenset({"t2i", "i2i"}),
        defaults=SamplingDefaults(num_inference_steps=28, guidance_scale=2.5),
        profile=ProfileFacts(dit_supports_layerwise=True),
        size_multiple=16,  # diffusers' FluxKontextPipeline: VAE 8 x 2x2 packing
        max_image_inputs=1,
        base_family="flux",
    ),
)
