"""Stable Diffusion 3 / 3.5 (two CLIP encoders and T5)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults, TextEncoderFacts


def sd3_max_latent_side(cfg: dict) -> int | None:
    """SD3 crops a fixed table of `pos_embed_max_size` patches per side."""
    size = cfg.get("pos_embed_max_size")
    return int(size) * int(cfg.get("patch_size", 2)) if size else None


SPEC = FamilySpec(
    name="sd3",
    pipeline_classes=("StableDiffusion3Pipeline",),
    model_id_patterns=(r"stable[-_]?diffusion[-_]?3|sd3",),
    native_adapter="diffuserve.pipelines.sd3:SD3NativePipeline",
    # diffusers' call defaults; CFG runs whenever guidance_scale > 1, against "" when no negative is given.
    defaults=SamplingDefaults(num_inference_steps=28, guidance_scale=7.0),
    # Layer-wise offload of the DiT (transformer_blocks) is tested to reproduce the resident output.
    profile=ProfileFacts(default_uses_cfg=True, dit_supports_layerwise=True, cfg_batched=True),
    layer_containers={"SD3Transformer2DModel": (("transformer_blocks", "num_layers"),)},
    max_latent_side=sd3_max_latent_side,
    tiny_builds={"sd3": "diffuserve.models.tiny_sd3:build"},
    # Two CLIPs (77 tokens each) and T5 (diffusers' max_sequence_length 256); T5 may be left out.
    text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (CLIP-L)", 77),
                   TextEncoderFacts("tokenizer_2", "text_encoder_2 (CLIP-G)", 77),
                   TextEncoderFacts("tokenizer_3", "text_encoder_3 (T5)", 256)),
)
