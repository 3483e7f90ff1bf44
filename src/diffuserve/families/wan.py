"""Wan2.1 / Wan2.2 text-to-video (one spec: A14B's two experts and TI2V-5B's per-token timesteps are settings of
the same `WanPipeline` class) and Wan image-to-video."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults, TextEncoderFacts

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

SPECS = (
    FamilySpec(
        name="wan",
        pipeline_classes=("WanPipeline",),
        model_id_patterns=(r"wan",),
        output_kind="video",
        tasks=frozenset({"t2v"}),
        defaults=SamplingDefaults(width=832, height=480, num_frames=81, num_inference_steps=50,
                                  guidance_scale=5.0, fps=16),
        profile=WAN_PROFILE,
        layer_containers=WAN_LAYERS,
        max_latent_side=wan_max_latent_side,
        native_adapter="diffuserve.pipelines.wan:WanNativePipeline",
        tiny_builds={
            "wan": "diffuserve.models.tiny:build_wan",
            "wan2.2": "diffuserve.models.tiny_wan:build_wan22_a14b",
            "wan2.2-ti2v": "diffuserve.models.tiny_wan:build_wan22_ti2v",
        },
        text_encoders=WAN_TEXT_ENCODERS,
    ),
    FamilySpec(
        name="wan_i2v",
        pipeline_classes=("WanImageToVideoPipeline",),
        model_id_patterns=(r"wan.*i2v",),
        id_priority=10,
        output_kind="video",
        tasks=frozenset({"i2v"}),
        defaults=SamplingDefaults(width=832, height=480, num_frames=81, num_inference_steps=50,
                                  guidance_scale=5.0, fps=16),
        profile=WAN_PROFILE,
        layer_containers=WAN_LAYERS,
        max_latent_side=wan_max_latent_side,
        max_image_inputs=1,
        supports_batching=False,
        base_family="wan",
        native_adapter="diffuserve.pipelines.wan:WanI2VNativePipeline",
        tiny_builds={"wan-i2v": "diffuserve.models.tiny_wan:build_wan_i2v"},
        text_encoders=WAN_TEXT_ENCODERS,
    ),
)
