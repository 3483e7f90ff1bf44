"""Wan2.1 / Wan2.2 text-to-video (one spec: A14B's two experts and TI2V-5B's per-token timesteps are settings of
the same `WanPipeline` class) and Wan image-to-video."""

from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    GuidanceRule,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_frame_count, check_one_image

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


def check_wan(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """Wan: a frame count its VAE takes; the second expert's fields only on a two-expert Wan2.2 checkpoint
    (`rules.facts["two_experts"]`), with a boundary inside (0, 1)."""
    check_frame_count(params.num_frames, rules.frame_multiple, model="Wan")
    for name in ("guidance_scale_2", "boundary_ratio"):
        if getattr(params, name) is not None and not rules.facts.get("two_experts", False):
            raise InvalidRequestError(
                f"{name} applies only to two-expert Wan2.2 checkpoints "
                "(boundary_ratio in model_index.json); this one has one transformer.",
                param=name,
            )
    if params.boundary_ratio is not None and not 0.0 < params.boundary_ratio < 1.0:
        raise InvalidRequestError(
            f"boundary_ratio={params.boundary_ratio} must be between 0 and 1 (exclusive): "
            "the timestep share at which the low-noise expert takes over.",
            param="boundary_ratio",
        )


def check_wan_i2v(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """Wan image-to-video: Wan's checks, and exactly one input image."""
    check_wan(params, rules)
    check_one_image(params, "this Wan image-to-video model needs exactly one input image (`input_reference`).")


SPECS = (
    FamilySpec(
        quant_keep=WAN_QUANT_KEEP,
        name="wan",
        guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_one"),
        request_check=check_wan,
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
        native_adapter="diffuserve.families.wan.adapter:WanAdapter",
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
        guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_one"),
        request_check=check_wan_i2v,
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
        native_adapter="diffuserve.families.wan.adapter:WanI2VAdapter",
        required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        lora_loader="WanLoraLoaderMixin",
        tiny_builds={"wan-i2v": "diffuserve.families.wan.tiny:build_wan_i2v"},
    ),
)
