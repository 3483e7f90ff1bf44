"""HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`) and image-to-video (`HunyuanVideo15ImageToVideoPipeline`).

Its DiT computes RoPE on the fly (no position table): no `max_latent_side`. The size multiple is the VAE's spatial
compression times the DiT's patch (16 x 1 for the published checkpoints, 4 x 1 for the tiny ones).
"""

import dataclasses
from typing import Any

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

HUNYUAN_15_TEXT_ENCODERS = (
    TextEncoderFacts("tokenizer", "text_encoder (Qwen2.5-VL)", 1000),
    TextEncoderFacts("tokenizer_2", "text_encoder_2 (ByT5 glyphs)", 256),
)
"""diffusers' `tokenizer_max_length` (after the 108-token system template is cropped) and the ByT5 glyph length."""

# Like Wan: the video VAE peaks high and frames and resolution move the DiT's peak too much for one auto threshold.
HUNYUAN_15_PROFILE = ProfileFacts(
    default_uses_cfg=True,
    dit_resident_threshold_gib=None,
    vae_resident_threshold_gib=40.0,
    fsdp_can_replace_dit_offload=True,
    dit_supports_layerwise=True,
    sequence_parallel=True,
    tensor_parallel=True,
)
HUNYUAN_15_LAYERS = {
    "HunyuanVideo15Transformer3DModel": (("transformer_blocks", "num_layers"),),
    # The video VAE: the decoder first (decode is the serving path, so a resident layer set takes decoder blocks).
    "AutoencoderKLHunyuanVideo15": (("decoder.up_blocks", None), ("encoder.down_blocks", None)),
    # The text model of Qwen2.5-VL on its own (Qwen-Image loads the whole conditional-generation class).
    "Qwen2_5_VLTextModel": (("layers", "num_hidden_layers"),),
    "SiglipVisionModel": (("encoder.layers", "num_hidden_layers"),),
}
"""The repeated blocks of the family's classes: what layer-wise offload streams and the step caches hook."""

HUNYUAN_15_DEFAULTS = SamplingDefaults(
    width=848, height=480, num_frames=121, num_inference_steps=50, guidance_scale=6.0, fps=24
)
"""The 480p checkpoints' figures (diffusers' call defaults: 121 frames, 50 steps; guidance from the saved guider)."""

# The patch and context embedders (diffusers skips them in layer-wise casting), the final projection and the norms
# stay in the compute dtype.
HUNYUAN_15_QUANT_KEEP = ("x_embedder.*", "context_embedder.*", "context_embedder_2.*", "image_embedder.*", "proj_out")


def hunyuan_15_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """The VAE's `spatial_compression_ratio` times the DiT's spatial `patch_size`."""
    return LatentGeometry(
        vae_factor=int(configs["vae"]["spatial_compression_ratio"]),
        patch=int(configs["transformer"].get("patch_size") or 1),
    )


def hunyuan_15_defaults(
    defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry
) -> SamplingDefaults:
    """The guidance scale of the checkpoint's saved guider (diffusers' `__call__` takes none: the guider decides),
    when the loaded configs carry it."""
    guider = configs.get("guider") or {}
    if "guidance_scale" in guider:
        return dataclasses.replace(defaults, guidance_scale=float(guider["guidance_scale"]))
    return defaults


_COMMON = {
    "quant_keep": HUNYUAN_15_QUANT_KEEP,
    "text_encoders": HUNYUAN_15_TEXT_ENCODERS,
    "output_kind": "video",
    "defaults": HUNYUAN_15_DEFAULTS,
    "profile": HUNYUAN_15_PROFILE,
    "layer_containers": HUNYUAN_15_LAYERS,
    "latent_geometry": hunyuan_15_geometry,
    "checkpoint_defaults": hunyuan_15_defaults,
    # diffusers 0.42 has no 1.5-specific mixin; HunyuanVideo's reads diffusers-format `transformer.*` adapters.
    "lora_loader": "HunyuanVideoLoraLoaderMixin",
    "text_encoder_keys": ("text_encoder", "text_encoder_2"),
}

HUNYUAN_15_COMPONENTS = (
    "transformer",
    "vae",
    "text_encoder",
    "tokenizer",
    "text_encoder_2",
    "tokenizer_2",
    "scheduler",
)
"""The components every HunyuanVideo 1.5 checkpoint has (the guider is optional: it only names the default scale)."""


def check_hunyuan_video15(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """HunyuanVideo 1.5: a frame count its VAE takes."""
    check_frame_count(params.num_frames, rules.frame_multiple, model="HunyuanVideo 1.5")


def check_hunyuan_video15_i2v(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """HunyuanVideo 1.5 image-to-video: the frame count, and exactly one input image."""
    check_hunyuan_video15(params, rules)
    check_one_image(
        params, "this HunyuanVideo 1.5 image-to-video model needs exactly one input image (`input_reference`)."
    )


SPECS = (
    FamilySpec(
        name="hunyuan_video_15",
        guidance=GuidanceRule(scale_field="guidance_scale", runs_when="not_one"),
        request_check=check_hunyuan_video15,
        pipeline_classes=("HunyuanVideo15Pipeline",),
        model_id_patterns=(r"hunyuan[-_]?video[-_]?1[._-]?5",),
        id_priority=10,
        tasks=frozenset({"t2v"}),
        native_adapter="diffuserve.families.hunyuan_video15.adapter:HunyuanVideo15Adapter",
        required_components=HUNYUAN_15_COMPONENTS,
        # Rows merge: the native decode runs the VAE one row at a time (diffusers 0.42.1's VAE cannot decode a
        # batch, see adapter.py). Continuous: FlowMatchEuler is stateless per step beyond its sigma index, and each
        # request owns a private scheduler copy.
        supports_continuous=True,
        tiny_builds={"hunyuan-video-1.5": "diffuserve.families.hunyuan_video15.tiny:build_hunyuan_video_15"},
        **_COMMON,
    ),
    FamilySpec(
        name="hunyuan_video_15_i2v",
        guidance=GuidanceRule(scale_field="guidance_scale", runs_when="not_one"),
        request_check=check_hunyuan_video15_i2v,
        pipeline_classes=("HunyuanVideo15ImageToVideoPipeline",),
        model_id_patterns=(r"hunyuan[-_]?video[-_]?1[._-]?5.*i2v",),
        id_priority=20,
        tasks=frozenset({"i2v"}),
        native_adapter="diffuserve.families.hunyuan_video15.adapter:HunyuanVideo15I2VAdapter",
        required_components=(*HUNYUAN_15_COMPONENTS, "image_encoder", "feature_extractor"),
        max_image_inputs=1,
        base_family="hunyuan_video_15",
        # Rows with different input images merge (each row encodes its own image); image-conditioned requests
        # do not join a continuous group.
        tiny_builds={"hunyuan-video-1.5-i2v": "diffuserve.families.hunyuan_video15.tiny:build_hunyuan_video_15_i2v"},
        **_COMMON,
    ),
)
