"""Video families served through the diffusers backend (no native adapter yet).

Their DiTs compute RoPE on the fly (no position table), so none declares `max_latent_side`. `size_multiple` is
the diffusers pipeline class's own check (HunyuanVideo, Helios: 16; LTX: 32); the backend refuses other
sizes with a 400 before queueing.
"""

from diffuserve.families.base import FamilySpec, ProfileFacts

# Unprofiled video: no auto DiT residency; frames and resolution decide its peak (the seed's rule).
_VIDEO_PROFILE = ProfileFacts(dit_resident_threshold_gib=None)
_TINY = "diffuserve.families.video_others.tiny"

SPECS = (
    FamilySpec(
        name="hunyuan_video",
        pipeline_classes=("HunyuanVideoPipeline",),
        model_id_patterns=(r"hunyuan[-_]?video",),
        output_kind="video",
        tasks=frozenset({"t2v"}),
        profile=_VIDEO_PROFILE,
        size_multiple=16,
        tiny_builds={"hunyuan-video": f"{_TINY}:build_hunyuan_video"},
    ),
    # Its own spec because it cannot batch: diffusers 0.42.1's AutoencoderKLHunyuanVideo15 mid-block attention
    # builds a (batch, S, S) causal mask against (batch, 1, S, C) queries, so decoding two videos at once fails
    # ("output with shape [2, 1, S, S] doesn't match the broadcast shape [2, 2, S, S]").
    FamilySpec(
        name="hunyuan_video_15",
        pipeline_classes=("HunyuanVideo15Pipeline",),
        model_id_patterns=(r"hunyuan[-_]?video[-_]?1[._-]?5",),
        id_priority=10,
        output_kind="video",
        tasks=frozenset({"t2v"}),
        profile=_VIDEO_PROFILE,
        supports_batching=False,
        size_multiple=16,
        tiny_builds={"hunyuan-video-1.5": f"{_TINY}:build_hunyuan_video_15"},
    ),
    FamilySpec(
        name="ltx",
        pipeline_classes=("LTXPipeline",),
        model_id_patterns=(r"ltx",),
        output_kind="video",
        tasks=frozenset({"t2v"}),
        profile=_VIDEO_PROFILE,
        size_multiple=32,
    ),
    FamilySpec(
        name="helios",
        pipeline_classes=("HeliosPipeline",),
        model_id_patterns=(r"helios",),
        output_kind="video",
        tasks=frozenset({"t2v"}),
        profile=_VIDEO_PROFILE,
        size_multiple=16,
        tiny_builds={"helios": f"{_TINY}:build_helios"},
    ),
)
