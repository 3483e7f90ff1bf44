"""Qwen-Image (and 2512): Qwen2.5-VL text, MM-DiT, norm-rescaled true CFG; Qwen-Image 2.1: Qwen3-VL text,
single-stream block-causal DiT with a prefix KV cache."""

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
        native_adapter="diffuserve.pipelines.qwen_image:QwenImageNativePipeline",
        # diffusers' call defaults: 1024x1024 (default_sample_size 128 x VAE 8), 50 steps, true_cfg_scale 4 and
        # no negative prompt, so true CFG runs only when a request brings one (Qwen's own example passes " ").
        # The same defaults as `--backend diffusers`, so an unset field means the same on both backends.
        defaults=SamplingDefaults(width=1024, height=1024, num_inference_steps=50, guidance_scale=1.0,
                                  true_cfg_scale=4.0, negative_prompt=None),
        profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True),
        layer_containers=QWEN_IMAGE_LAYERS,
        # VAE 8x, then 2x2 patches per token; the checkpoint's RoPE table sets max_width/max_height.
        size_multiple=16,
        tiny_builds={"qwen-image": "diffuserve.models.tiny_qwen_image:build_qwen_image"},
    ),
    FamilySpec(
        name="qwen_image_21",
        pipeline_classes=("QwenImage21Pipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_.]?2\.?1",),
        id_priority=5,
        native_adapter="diffuserve.pipelines.qwen_image:QwenImage21NativePipeline",
        # diffusers' call defaults: output_resolution 1024, 40 steps, true_cfg_scale 1 (2.1 samples without
        # guidance); a Turbo checkpoint's `sample_sigmas` fixes the step count instead (the adapter reads it).
        defaults=SamplingDefaults(width=1024, height=1024, num_inference_steps=40, guidance_scale=1.0,
                                  true_cfg_scale=1.0, negative_prompt=None),
        profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True),
        layer_containers={"QwenImage21Transformer2DModel": (("transformer_blocks", "num_layers"),)},
        # VAE 16x, and each encoder image slot stands for 2x2 latent tokens.
        size_multiple=32,
        tiny_builds={"qwen-image-2.1": "diffuserve.models.tiny_qwen_image:build_qwen_image_21"},
        base_family="qwen_image",
    ),
)
