"""FLUX.2-dev (Mistral3 encoder) and FLUX.2-Klein 4B/9B / Klein-Base (Qwen3 encoder).

Both run natively (`pipelines/flux2.py`), text-to-image and with reference images on /v1/images/edits (the
diffusers pipelines' `image=`). Sizes are multiples of 16 (VAE factor 8 x 2x2 patches); RoPE is computed from
position ids, so no positional table limits the size.
"""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults, TextEncoderFacts

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
        native_adapter="diffuserve.pipelines.flux2:Flux2NativePipeline",
        # diffusers' Flux2Pipeline call defaults: 50 steps, embedded guidance 4.0 (guidance-distilled: no CFG).
        defaults=SamplingDefaults(num_inference_steps=50, guidance_scale=4.0),
        # The published DiT is ~32B parameters (~64 GB in bf16): resident only on a GPU with room for it.
        profile=ProfileFacts(dit_resident_threshold_gib=80.0, dit_supports_layerwise=True),
        layer_containers=_FLUX2_LAYERS,
        max_image_inputs=4,
        tiny_builds={"flux2": "diffuserve.models.tiny_flux2:build_flux2"},
        # The chat-formatted prompt (system message + user turn), 512 tokens (diffusers' max_sequence_length).
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Mistral3)", 512),),
    ),
    FamilySpec(
        name="flux2_klein",
        pipeline_classes=("Flux2KleinPipeline",),
        model_id_patterns=(r"flux\.?2[-_.]?klein",),
        id_priority=30,
        tasks=frozenset({"t2i", "i2i"}),
        native_adapter="diffuserve.pipelines.flux2:Flux2KleinNativePipeline",
        # The step-distilled Klein 4B/9B: 4 steps, guidance ignored. The adapter gives Klein-Base
        # (model_index.json `is_distilled: false`) diffusers' call defaults instead: 50 steps, CFG at 4.0.
        defaults=SamplingDefaults(num_inference_steps=4, guidance_scale=1.0),
        profile=ProfileFacts(dit_resident_threshold_gib=24.0, dit_supports_layerwise=True),
        layer_containers=_FLUX2_LAYERS,
        max_image_inputs=4,
        tiny_builds={"flux2-klein": "diffuserve.models.tiny_flux2:build_flux2_klein"},
        base_family="flux2",
        text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Qwen3)", 512),),
    ),
)
