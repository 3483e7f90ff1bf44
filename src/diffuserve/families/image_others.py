"""Image families served through the diffusers backend (no native adapter yet)."""

from diffuserve.families.base import FamilySpec

SPECS = (
    FamilySpec(name="glm_image", pipeline_classes=("GlmImagePipeline",), model_id_patterns=(r"glm[-_]?image",)),
    FamilySpec(name="ernie_image", pipeline_classes=("ErnieImagePipeline",), model_id_patterns=(r"ernie[-_]?image",)),
    FamilySpec(name="qwen_image_layered", pipeline_classes=("QwenImageLayeredPipeline",),
               model_id_patterns=(r"qwen[-_]?image[-_]?layered",), id_priority=12, base_family="qwen_image"),
)
