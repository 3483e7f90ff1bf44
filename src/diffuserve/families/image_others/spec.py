"""Image families served through the diffusers backend (no native adapter yet)."""

from diffuserve.family_spec.base import FamilySpec, ProfileFacts, SamplingDefaults

_TINY = "diffuserve.families.image_others.tiny"

SPECS = (
    # GLM-Image: an AR model writes prior tokens (one per 32 px), then the DiT; merged requests share one batched
    # AR call with per-request sampling (pipelines/glm_image_ar.py), DiT and VAE per request. Text-to-image only.
    FamilySpec(
        name="glm_image",
        pipeline_classes=("GlmImagePipeline",),
        model_id_patterns=(r"glm[-_]?image",),
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.5),
        profile=ProfileFacts(default_uses_cfg=True),
        size_multiple=32,
        tiny_builds={"glm-image": f"{_TINY}:build_glm_image"},
    ),
    # ERNIE-Image: RoPE computed from positions on the fly (no table limit); CFG on by default (guidance 4).
    FamilySpec(
        name="ernie_image",
        pipeline_classes=("ErnieImagePipeline",),
        model_id_patterns=(r"ernie[-_]?image",),
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=4.0),
        profile=ProfileFacts(default_uses_cfg=True),
        size_multiple=16,
        tiny_builds={"ernie-image": f"{_TINY}:build_ernie_image"},
    ),
    # Qwen-Image-Layered decomposes ONE input image into layers: an edit-style request that never merges; its `n`
    # is the number of layers (diffusers_backend.py), and the output size follows the input image, not `size`.
    FamilySpec(
        name="qwen_image_layered",
        pipeline_classes=("QwenImageLayeredPipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_]?layered",),
        id_priority=12,
        base_family="qwen_image",
        tasks=frozenset({"i2i"}),
        max_image_inputs=1,
        supports_batching=False,
        output_size_follows_input=True,
        size_multiple=16,
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.0),
        tiny_builds={"qwen-image-layered": f"{_TINY}:build_qwen_image_layered"},
    ),
)
