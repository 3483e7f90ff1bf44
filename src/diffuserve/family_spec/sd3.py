"""Stable Diffusion 3 / 3.5 (two CLIP encoders and T5)."""

import dataclasses
from typing import Any

from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    GuidanceRule,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.components import autoencoder_kl_factor
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_control, check_strength

# Two CLIPs (77 tokens each) and T5 (diffusers' max_sequence_length 256); T5 may be left out.


def sd3_max_latent_side(cfg: dict) -> int | None:
    """SD3 crops a fixed table of `pos_embed_max_size` patches per side."""
    size = cfg.get("pos_embed_max_size")
    return int(size) * int(cfg.get("patch_size", 2)) if size else None


def sd3_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """AutoencoderKL (8x), then the DiT's patches."""
    return LatentGeometry(
        vae_factor=autoencoder_kl_factor(configs["vae"]), patch=int(configs["transformer"]["patch_size"])
    )


def sd3_defaults(defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry) -> SamplingDefaults:
    """diffusers' default size is the transformer's sample size in latent pixels (1024 px for the real models,
    64 px for the tiny one); steps and guidance are the spec's (diffusers' call defaults)."""
    size = int(configs["transformer"]["sample_size"]) * geometry.vae_factor
    return dataclasses.replace(defaults, width=size, height=size)


# SD3's patch and context embedders, timestep / pooled-text embedders and the final layer stay in the compute dtype;
# the per-block AdaLN projections are quantized with per-row scales, as FLUX.1's.
SD3_QUANT_KEEP = ("pos_embed.*", "context_embedder", "time_text_embed.*", "norm_out.*", "proj_out")

SD3_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
"""Components every SD3 checkpoint has; T5 (`text_encoder_3`, `tokenizer_3`) may be left out, as diffusers allows."""


def check_sd3(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """SD3: its ControlNet fields; an edit's strength."""
    check_control(params, rules)
    check_strength(params)


SPEC = FamilySpec(
    quant_keep=SD3_QUANT_KEEP,
    name="sd3",
    guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_one"),
    request_check=check_sd3,
    text_encoders=(
        TextEncoderFacts("tokenizer", "text_encoder (CLIP-L)", 77),
        TextEncoderFacts("tokenizer_2", "text_encoder_2 (CLIP-G)", 77),
        TextEncoderFacts("tokenizer_3", "text_encoder_3 (T5)", 256),
    ),
    pipeline_classes=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    # Edits as diffusers' SD3 img2img (no mask) and inpaint (a mask) pipelines start and blend (pipelines/inpaint.py).
    # Edits of different strengths share a call: each row starts at its own step of the shared schedule.
    strength_per_row=True,
    tasks=frozenset({"t2i", "i2i", "inpaint"}),
    max_image_inputs=1,
    model_id_patterns=(r"stable[-_]?diffusion[-_]?3|sd3",),
    native_adapter="diffuserve.families.sd3.adapter:SD3Adapter",
    required_components=SD3_COMPONENTS,
    lora_loader="SD3LoraLoaderMixin",
    controlnet_classes=("SD3ControlNetModel",),
    # diffusers' call defaults; CFG runs whenever guidance_scale > 1, against "" when no negative is given.
    defaults=SamplingDefaults(num_inference_steps=28, guidance_scale=7.0),
    checkpoint_defaults=sd3_defaults,
    # Layer-wise offload of the DiT (transformer_blocks) is tested to reproduce the resident output.
    profile=ProfileFacts(default_uses_cfg=True, dit_supports_layerwise=True),
    # diffusers runs SD3's CFG as one doubled batch; so does the adapter (two passes round differently: +-1 level).
    cfg_batched=True,
    # Flow-match Euler per request; the transformer takes a per-row timestep; fixed-length text (verified row by
    # row against the singleton run in a mixed group, tests/integration/test_continuous_steps.py).
    supports_continuous=True,
    # Rows of different sizes share one call: per-group patch embedding, padded and masked (pipelines/packing.py).
    packs_mixed_sizes=True,
    # T5 (text_encoder_3) is optional: a checkpoint saved without it encodes zeros in its place, as diffusers.
    text_encoder_keys=("text_encoder", "text_encoder_2", "text_encoder_3"),
    latent_geometry=sd3_geometry,
    layer_containers={"SD3Transformer2DModel": (("transformer_blocks", "num_layers"),)},
    max_latent_side=sd3_max_latent_side,
    tiny_builds={"sd3": "diffuserve.families.sd3.tiny:build", "sd3_16ch": "diffuserve.families.sd3.tiny:build_16ch"},
)
