"""Wan2.1 / Wan2.2 text-to-video and Wan image-to-video."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults

# Wan: FSDP can replace DiT offload on validated multi-GPU set-ups; the video VAE peaks high, and frames and
# resolution move the DiT peak too much for one auto threshold.
WAN_PROFILE = ProfileFacts(
    default_uses_cfg=True,
    dit_resident_threshold_gib=None,
    vae_resident_threshold_gib=40.0,
    fsdp_can_replace_dit_offload=True,
    dit_supports_layerwise=True,
)
WAN_LAYERS = {"WanTransformer3DModel": (("blocks", "num_layers"),)}

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
        tiny_builds={"wan": "diffuserve.models.tiny:build_wan"},
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
        max_image_inputs=1,
        supports_batching=False,
        base_family="wan",
    ),
)
