"""FLUX.1 (dev, schnell) and FLUX.1 Kontext."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults, TextEncoderFacts

# CLIP's 77 tokens (pooled), then T5: diffusers' max_sequence_length 512 (capped by what tokenizer_2 declares).
FLUX_TEXT_ENCODERS = (TextEncoderFacts("tokenizer", "text_encoder (CLIP)", 77),
                      TextEncoderFacts("tokenizer_2", "text_encoder_2 (T5)", 512))

SPECS = (
    FamilySpec(
        name="flux",
        pipeline_classes=("FluxPipeline", "FluxImg2ImgPipeline"),
        model_id_patterns=(r"flux",),
        id_priority=0,
        tasks=frozenset({"t2i", "i2i"}),
        native_adapter="diffuserve.pipelines.flux:FluxNativePipeline",
        # FLUX.1-dev: guidance-distilled (embedded guidance 3.5), 28 steps at 1024^2; the adapter switches
        # to schnell's 4 steps without guidance when the transformer has no guidance embedding.
        defaults=SamplingDefaults(width=1024, height=1024, num_inference_steps=28, guidance_scale=3.5),
        # One branch per step by default; the native adapter streams double and single blocks.
        profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True, sequence_parallel=True,
                             tensor_parallel=True),
        layer_containers={
            "FluxTransformer2DModel": (
                ("transformer_blocks", "num_layers"),
                ("single_transformer_blocks", "num_single_layers"),
            ),
        },
        size_multiple=16,
        max_image_inputs=1,
        tiny_builds={"flux": "diffuserve.models.tiny:build_flux"},
        text_encoders=FLUX_TEXT_ENCODERS,
    ),
    FamilySpec(
        name="flux_kontext",
        pipeline_classes=("FluxKontextPipeline",),
        model_id_patterns=(r"flux\.?1?[-_.]?kontext",),
        id_priority=10,
        tasks=frozenset({"t2i", "i2i"}),
        defaults=SamplingDefaults(num_inference_steps=28, guidance_scale=2.5),
        profile=ProfileFacts(dit_supports_layerwise=True),
        max_image_inputs=1,
        base_family="flux",
        text_encoders=FLUX_TEXT_ENCODERS,
    ),
)
