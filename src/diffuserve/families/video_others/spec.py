"""Video families served through the diffusers backend (no native adapter yet).

Their DiTs compute RoPE on the fly (no position table), so none declares `max_latent_side`. `size_multiple` is
the diffusers pipeline class's own check (HunyuanVideo, Helios: 16; LTX: 32); the backend refuses other
sizes with a 400 before queueing.
"""

from diffuserve.family_spec.base import FamilySpec, ProfileFacts

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
