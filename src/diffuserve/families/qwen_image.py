"""Qwen-Image (and 2512) and Qwen-Image 2.1 (Qwen2.5-VL encoder, true CFG)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults

QWEN_IMAGE_LAYERS = {"QwenImageTransformer2DModel": (("transformer_blocks", "num_layers"),)}
"""The Qwen-Image DiT's repeated blocks (shared with the edit families)."""

# Qwen-Image runs true CFG; FSDP was not measured faster there, so auto keeps the non-FSDP path.
QWEN_PROFILE = ProfileFacts(default_uses_cfg=True, dit_supports_layerwise=True)

SPECS = (
    FamilySpec(
        name="qwen_image",
        pipeline_classes=("QwenImagePipeline",),
        model_id_patterns=(r"qwen[-_]?image",),
        id_priority=0,
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.0, true_cfg_scale=4.0,
                                  negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
    ),
    FamilySpec(
        name="qwen_image_21",
        pipeline_classes=("QwenImage21Pipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_.]?2\.?1",),
        id_priority=5,
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.0, true_cfg_scale=4.0,
                                  negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        base_family="qwen_image",
    ),
)
