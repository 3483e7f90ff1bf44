"""SANA 1.5 / 600M / 1600M (Gemma2 encoder, DC-AE VAE)."""

from diffuserve.families.base import FamilySpec, ProfileFacts, SamplingDefaults, TextEncoderFacts

SPEC = FamilySpec(
    name="sana",
    pipeline_classes=("SanaPipeline",),
    model_id_patterns=(r"sana",),
    native_adapter="diffuserve.pipelines.sana:SanaNativePipeline",
    defaults=SamplingDefaults(num_inference_steps=20, guidance_scale=4.5),
    profile=ProfileFacts(default_uses_cfg=True, cfg_batched=True),
    layer_containers={"SanaTransformer2DModel": (("transformer_blocks", "num_layers"),)},
    size_multiple=32,
    tiny_builds={"sana": "diffuserve.models.tiny_sana:build"},
    # After the complex-human instruction, the prompt keeps max_sequence_length (300) positions, <bos> included.
    text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Gemma2)", 300),),
)
