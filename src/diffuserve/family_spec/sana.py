"""SANA 1.5 / 600M / 1600M (Gemma2 encoder, DC-AE VAE)."""

import dataclasses

from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    GuidanceRule,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)

# After the complex-human instruction, the prompt keeps max_sequence_length (300) positions, <bos> included.


def sana_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """The DC-AE halves the side at every encoder level but the last (32x), then the DiT's patches."""
    return LatentGeometry(
        vae_factor=2 ** (len(configs["vae"]["encoder_block_out_channels"]) - 1),
        patch=int(configs["transformer"]["patch_size"]),
    )


def sana_defaults(defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry) -> SamplingDefaults:
    """The size: the transformer's sample_size is in latent pixels (32 -> 1024 px upstream); a tiny checkpoint's 16
    would be 512 px, which binning would generate anyway, so the tiny one suggests 64 px through its model_index."""
    size = int(configs["transformer"]["sample_size"]) * geometry.vae_factor
    return dataclasses.replace(defaults, width=size, height=size)


# SANA's patch embedder, caption projection, timestep embedder (with its AdaLN-single projection) and final projection
# stay in the compute dtype.
SANA_QUANT_KEEP = ("patch_embed.*", "caption_projection.*", "time_embed.*", "proj_out")

SPEC = FamilySpec(
    quant_keep=SANA_QUANT_KEEP,
    name="sana",
    guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_one"),
    text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Gemma2)", 300),),
    pipeline_classes=("SanaPipeline",),
    model_id_patterns=(r"sana",),
    native_adapter="diffuserve.families.sana.adapter:SanaAdapter",
    required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    lora_loader="SanaLoraLoaderMixin",
    defaults=SamplingDefaults(num_inference_steps=20, guidance_scale=4.5),
    checkpoint_defaults=sana_defaults,
    profile=ProfileFacts(default_uses_cfg=True),
    # diffusers runs [negatives, positives] as one doubled call; per-row results do not depend on the order inside
    # a call, but do (~1e-6) on the call's size, so the doubled call keeps them bit-equal. The adapter's `predict`
    # also relies on it: the doubled call is how it knows which rows take the negative encoding.
    cfg_batched=True,
    # Continuous: each request keeps its own DPM-Solver++ history, and a mixed step gets the group's row count.
    supports_continuous=True,
    # Cannot pack sizes: its Mix-FFN runs a depthwise 3x3 conv on each row's (h, w) grid, and its ReLU linear
    # attention sums keys over the whole sequence with no mask, so padding changes every row; size-grouped batches.
    packs_mixed_sizes=False,
    text_encoder_keys=("text_encoder",),
    layer_containers={"SanaTransformer2DModel": (("transformer_blocks", "num_layers"),)},
    latent_geometry=sana_geometry,
    tiny_builds={"sana": "diffuserve.families.sana.tiny:build"},
)
