"""FLUX.2-dev (Mistral3 encoder) and FLUX.2-Klein 4B/9B / Klein-Base (Qwen3 encoder).

Both run natively (`families/flux2/adapter.py`), text-to-image and with reference images on /v1/images/edits (the
diffusers pipelines' `image=`); Klein also inpaints (edits with a `mask`, as Flux2KleinInpaintPipeline). Sizes are
multiples of 16 (VAE factor 8 x 2x2 patches); RoPE is computed from position ids, so no positional table limits the
size.
"""

import dataclasses

from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.checkpoint import square_default
from diffuserve.family_spec.flux import flux_geometry

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

SPECS = (
    FamilySpec(
        quant_keep=FLUX2_QUANT_KEEP,
        name="flux2",
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Mistral3)", 512),),
        pipeline_classes=("Flux2Pipeline",),
        model_id_patterns=(r"flux\.?2",),
        id_priority=20,
        tasks=frozenset({"t2i", "i2i"}),
        native_adapter="diffuserve.families.flux2.adapter:Flux2NativePipeline",
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
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Qwen3)", 512),),
        pipeline_classes=("Flux2KleinPipeline", "Flux2KleinInpaintPipeline"),
        model_id_patterns=(r"flux\.?2[-_.]?klein",),
        id_priority=30,
        # Masks natively as Flux2KleinInpaintPipeline (`families/flux2/inpaint.py`); FLUX.2-dev has no inpaint pipeline.
        tasks=frozenset({"t2i", "i2i", "inpaint"}),
        native_adapter="diffuserve.families.flux2.adapter:Flux2KleinNativePipeline",
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
