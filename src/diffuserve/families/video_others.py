"""Video families served through the diffusers backend (no native adapter yet)."""

from diffuserve.families.base import FamilySpec, ProfileFacts

# Unprofiled video: no auto DiT residency; frames and resolution decide its peak (the seed's rule).
_VIDEO_PROFILE = ProfileFacts(dit_resident_threshold_gib=None)

SPECS = (
    FamilySpec(name="hunyuan_video", pipeline_classes=("HunyuanVideoPipeline", "HunyuanVideo15Pipeline"),
               model_id_patterns=(r"hunyuan[-_]?video",), output_kind="video", tasks=frozenset({"t2v"}),
               profile=_VIDEO_PROFILE),
    FamilySpec(name="ltx", pipeline_classes=("LTXPipeline",), model_id_patterns=(r"ltx",),
               output_kind="video", tasks=frozenset({"t2v"}), profile=_VIDEO_PROFILE),
    FamilySpec(name="ltx2", pipeline_classes=("LTX2Pipeline",), model_id_patterns=(r"ltx[-_]?2",), id_priority=10,
               output_kind="video", tasks=frozenset({"t2v"}), profile=_VIDEO_PROFILE),
    FamilySpec(name="helios", pipeline_classes=("HeliosPipeline",), model_id_patterns=(r"helios",),
               output_kind="video", tasks=frozenset({"t2v"}), profile=_VIDEO_PROFILE),
)
