"""Z-Image and Z-Image-Turbo (Qwen3 encoder)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults

SPEC = FamilySpec(
    name="z_image",
    pipeline_classes=("ZImagePipeline",),
    model_id_patterns=(r"z[-_]?image",),
    # Z-Image-Turbo samples without CFG in 8-9 steps; single-GPU no-offload measured faster than FSDP/SP.
    defaults=SamplingDefaults(num_inference_steps=9, guidance_scale=0.0),
    profile=ProfileFacts(default_uses_cfg=False),
    layer_containers={"ZImageTransformer2DModel": (("layers", "n_layers"),)},
)
