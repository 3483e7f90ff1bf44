"""FLUX.2-dev (Mistral3 encoder) and FLUX.2-Klein 4B/9B / Klein-Base (Qwen3 encoder)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults

_FLUX2_LAYERS = {
    "Flux2Transformer2DModel": (
        ("transformer_blocks", "num_layers"),
        ("single_transformer_blocks", "num_single_layers"),
    ),
}

SPECS = (
    FamilySpec(
        name="flux2",
        pipeline_classes=("Flux2Pipeline",),
        model_id_patterns=(r"flux\.?2",),
        id_priority=20,
        tasks=frozenset({"t2i", "i2i"}),
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=4.0),
        profile=ProfileFacts(dit_supports_layerwise=True),
        layer_containers=_FLUX2_LAYERS,
        max_image_inputs=4,
    ),
    FamilySpec(
        name="flux2_klein",
        pipeline_classes=("Flux2KleinPipeline",),
        model_id_patterns=(r"flux\.?2[-_.]?klein",),
        id_priority=30,
        tasks=frozenset({"t2i", "i2i"}),
        defaults=SamplingDefaults(num_inference_steps=4, guidance_scale=1.0),
        profile=ProfileFacts(dit_supports_layerwise=True),
        layer_containers=_FLUX2_LAYERS,
        max_image_inputs=4,
        base_family="flux2",
    ),
)
