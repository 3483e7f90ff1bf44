"""Wan2.1 / Wan2.2 text-to-video (one spec: A14B's two experts and TI2V-5B's per-token timesteps are settings of
the same `WanPipeline` class) and Wan image-to-video."""

from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)

WAN_TEXT_ENCODERS = (TextEncoderFacts("tokenizer", "text_encoder (UMT5)", 512),)
"""UMT5, diffusers' max_sequence_length 512 (capped by what the tokenizer declares)."""

# Wan: FSDP can replace DiT offload on validated multi-GPU set-ups; the video VAE peaks high, and frames and
# resolution move the DiT peak too much for one auto threshold.
WAN_PROFILE = ProfileFacts(
    default_uses_cfg=True,
    dit_resident_threshold_gib=None,
    vae_resident_threshold_gib=40.0,
    fsdp_can_replace_dit_offload=True,
    dit_supports_layerwise=True,
    sequence_parallel=True,
    tensor_parallel=True,
)
WAN_LAYERS = {"WanTransformer3DModel": (("blocks", "num_layers"),)}


def wan_max_latent_side(cfg: dict) -> int:
    """Wan's rotary table holds `rope_max_seq_len` positions per axis, counted in patches."""
    patch = cfg.get("patch_size") or (1, 2, 2)
    return int(cfg.get("rope_max_seq_len", 1024)) * int(patch[-1])


def wan_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """The VAE's spatial factor (`scale_factor_spatial`: 8 for Wan2.1, 16 for Wan2.2 TI2V-5B) times the spatial
    part of the DiT's (frames, height, width) patch."""
    patch = configs["transformer"].get("patch_size") or (1, 2, 2)
    return LatentGeometry(vae_factor=int(configs["vae"]["scale_factor_spatial"]), patch=int(patch[1]))


# Wan's patch embedding and condition embedders (diffusers keeps `time_embedder` in fp32 and skips `condition_embedder`
# in layer-wise casting) and the final projection stay in the compute dtype; its norms and `scale_shift_table` are no
# Linear.
WAN_QUANT_KEEP = ("patch_embedding", "condition_embedder.*", "proj_out")

SPECS = (
    FamilySpec(
        quant_keep=WAN_QUANT_KEEP,
        name="wan",
        text_encoders=WAN_TEXT_ENCODERS,
        pipeline_classes=("WanPipeline",),
        model_id_patterns=(r"wan",),
        output_kind="video",
        tasks=frozenset({"t2v"}),
        defaults=SamplingDefaults(
            width=832, height=480, num_frames=81, num_inference_steps=50, guidance_scale=5.0, fps=16
        ),
        profile=WAN_PROFILE,
        layer_containers=WAN_LAYERS,
        max_latent_side=wan_max_latent_side,
        latent_geometry=wan_geometry,
        native_adapter="diffuserve.families.wan.adapter:WanNativePipeline",
        required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        lora_loader="WanLoraLoaderMixin",
        # Continuous (Wan2.1, Wan2.2 TI2V-5B and A14B): UniPC keeps its multistep history per request. With two
        # experts (A14B) a step whose rows straddle the boundary makes one call per expert; guidance_scale_2 is in
        # the group key.
        supports_continuous=True,
        text_encoder_keys=("text_encoder",),
        tiny_builds={
            "wan": "diffuserve.families.wan.tiny:build_wan",
            "wan2.2": "diffuserve.families.wan.tiny:build_wan22_a14b",
            "wan2.2-ti2v": "diffuserve.families.wan.tiny:build_wan22_ti2v",
        },
    ),
    FamilySpec(
        quant_keep=WAN_QUANT_KEEP,
        name="wan_i2v",
        text_encoders=WAN_TEXT_ENCODERS,
        pipeline_classes=("WanImageToVideoPipeline",),
        model_id_patterns=(r"wan.*i2v",),
        id_priority=10,
        output_kind="video",
        tasks=frozenset({"i2v"}),
        defaults=SamplingDefaults(
            width=832, height=480, num_frames=81, num_inference_steps=50, guidance_scale=5.0, fps=16
        ),
        profile=WAN_PROFILE,
        layer_containers=WAN_LAYERS,
        max_latent_side=wan_max_latent_side,
        latent_geometry=wan_geometry,
        # Image-conditioned: not continuous.
        text_encoder_keys=("text_encoder",),
        max_image_inputs=1,
        supports_batching=False,
        base_family="wan",
        native_adapter="diffuserve.families.wan.adapter:WanI2VNativePipeline",
        required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        lora_loader="WanLoraLoaderMixin",
        tiny_builds={"wan-i2v": "diffuserve.families.wan.tiny:build_wan_i2v"},
    ),
)
