"""Z-Image and Z-Image-Turbo (Qwen3 encoder)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults, TextEncoderFacts

SPEC = FamilySpec(
    name="z_image",
    pipeline_classes=("ZImagePipeline",),
    model_id_patterns=(r"z[-_]?image",),
    native_adapter="diffuserve.pipelines.z_image:ZImageNativePipeline",
    # Z-Image-Turbo samples without CFG in 8-9 steps; single-GPU no-offload measured faster than FSDP/SP.
    defaults=SamplingDefaults(num_inference_steps=9, guidance_scale=0.0),
    # The native adapter streams the refiners and the main layers (tests: layer-wise equals resident).
    profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True, cfg_batched=True),
    # In execution order: the image-token refiner, the caption refiner, then the main single-stream layers.
    layer_containers={"ZImageTransformer2DModel": (
        ("noise_refiner", "n_refiner_layers"), ("context_refiner", "n_refiner_layers"), ("layers", "n_layers"),
    )},
    tiny_builds={"z-image": "diffuserve.models.tiny_z_image:build"},
    # The chat-templated prompt, diffusers' max_sequence_length 512 (the adapter also caps it by the DiT's caption axis).
    text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Qwen3)", 512),),
)
