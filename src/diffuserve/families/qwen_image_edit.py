"""Qwen-Image-Edit and Qwen-Image-Edit 2509/2511 (several input images)."""

from diffuserve.families.base import FamilySpec, SamplingDefaults, TextEncoderFacts
from diffuserve.families.qwen_image import QWEN_IMAGE_LAYERS, QWEN_PROFILE

# diffusers' edit pipelines give the processor the whole templated prompt (no max_sequence_length cut).
EDIT_TEXT_ENCODERS = (TextEncoderFacts("processor", "text_encoder (Qwen2.5-VL)", None),)

SPECS = (
    FamilySpec(
        name="qwen_image_edit",
        pipeline_classes=("QwenImageEditPipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_]?edit",),
        id_priority=10,
        tasks=frozenset({"i2i"}),
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=1.0, true_cfg_scale=4.0,
                                  negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        native_adapter="diffuserve.pipelines.qwen_image_edit:QwenImageEditNativePipeline",
        max_image_inputs=1,
        supports_batching=False,
        tiny_builds={"qwen-image-edit": "diffuserve.models.tiny_qwen_image_edit:build_edit"},
        base_family="qwen_image",
        text_encoders=EDIT_TEXT_ENCODERS,
    ),
    FamilySpec(
        name="qwen_image_edit_plus",
        pipeline_classes=("QwenImageEditPlusPipeline",),
        model_id_patterns=(r"qwen[-_]?image[-_]?edit[-_]?(2509|2511|plus)",),
        id_priority=15,
        tasks=frozenset({"i2i"}),
        defaults=SamplingDefaults(num_inference_steps=40, guidance_scale=1.0, true_cfg_scale=4.0,
                                  negative_prompt=" "),
        profile=QWEN_PROFILE,
        layer_containers=QWEN_IMAGE_LAYERS,
        native_adapter="diffuserve.pipelines.qwen_image_edit:QwenImageEditPlusNativePipeline",
        # The 2509/2511 model cards: multi-image editing works best with 1 to 3 input images.
        max_image_inputs=3,
        supports_batching=False,
        tiny_builds={"qwen-image-edit-plus": "diffuserve.models.tiny_qwen_image_edit:build_edit_plus"},
        base_family="qwen_image",
        text_encoders=EDIT_TEXT_ENCODERS,
    ),
)
