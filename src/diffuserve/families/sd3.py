"""Stable Diffusion 3 / 3.5 (two CLIP encoders and T5)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults

SPEC = FamilySpec(
    name="sd3",
    pipeline_classes=("StableDiffusion3Pipeline",),
    model_id_patterns=(r"stable[-_]?diffusion[-_]?3|sd3",),
    defaults=SamplingDefaults(num_inference_steps=28, guidance_scale=7.0),
    profile=ProfileFacts(default_uses_cfg=True),
    layer_containers={"SD3Transformer2DModel": (("transformer_blocks", "num_layers"),)},
    tiny_builds={"sd3": "diffuserve.models.tiny:build_sd3"},
)
