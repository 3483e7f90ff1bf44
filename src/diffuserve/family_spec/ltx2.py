"""LTX-2 and LTX-2.3: one joint audio-video transformer denoises the video tokens and the audio tokens together
(`LTX2Pipeline`; image-to-video is `LTX2ImageToVideoPipeline` on the same checkpoint)."""

from typing import Any

from diffuserve.family_spec.base import (
    FamilySpec,
    GuidanceRule,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_frame_count

AUDIO_GUIDANCE_SCALE = 7.0
"""diffusers' `audio_guidance_scale` default: the audio tokens' CFG scale (the video's is the request's
`guidance_scale`)."""

LTX2_TEXT_ENCODERS = (TextEncoderFacts("tokenizer", "text_encoder (Gemma3)", 1024),)
"""Gemma3, diffusers' max_sequence_length 1024 (left-padded; every hidden state feeds the text connectors)."""

# Unprofiled on large machines: frames and resolution decide the DiT peak (the seed's rule for video). Sequence
# parallel (Ulysses, Ring) splits the video tokens and replicates the audio tokens; the video-to-audio
# cross-attention all-gathers the video keys' input first (parallel/sequence_plans.py). Tensor parallel splits the
# heads of all six attentions of each block and both MLPs (parallel/tensor_plans.py); its q/k RMSNorms span all
# heads, so they all-reduce their sum of squares, and the RoPE tables are cut to each rank's features. CFG
# parallel, FSDP2, the sequence split and TP equal one process (tests/distributed/test_ltx2_parallel.py).
LTX2_PROFILE = ProfileFacts(
    default_uses_cfg=True,
    dit_resident_threshold_gib=None,
    vae_resident_threshold_gib=40.0,
    fsdp_can_replace_dit_offload=True,
    dit_supports_layerwise=True,
    sequence_parallel=True,
    tensor_parallel=True,
)
LTX2_LAYERS = {
    "LTX2VideoTransformer3DModel": (("transformer_blocks", "num_layers"),),
    # The video VAE: the decoder first (decode is the serving path; image-to-video also encodes one frame).
    "AutoencoderKLLTX2Video": (("decoder.up_blocks", None), ("encoder.down_blocks", None)),
}


# The patch embedders, the timestep / modulation embedders (adaLN singles, the cross-attention scale-shift and gates)
# and the output projections stay in the compute dtype, as diffusers keeps them out of layer-wise casting.
LTX2_QUANT_KEEP = (
    "proj_in",
    "audio_proj_in",
    "*time_embed*",
    "*adaln*",
    "av_cross_attn_*",
    "caption_projection.*",
    "audio_caption_projection.*",
    "proj_out",
    "audio_proj_out",
)


def check_ltx2(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """LTX-2: a frame count its video VAE takes."""
    check_frame_count(params.num_frames, rules.frame_multiple, model="LTX-2", vae="video VAE")


SPECS = (
    FamilySpec(
        quant_keep=LTX2_QUANT_KEEP,
        name="ltx2",
        guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_one", audio_scale=AUDIO_GUIDANCE_SCALE),
        run_apart_by=("fps",),
        peer_fields=frozenset({"generate_audio"}),
        request_check=check_ltx2,
        text_encoders=LTX2_TEXT_ENCODERS,
        pipeline_classes=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
        model_id_patterns=(r"ltx[-_]?2",),
        id_priority=10,
        output_kind="video",
        # Image-to-video is the same checkpoint with the first latent frame pinned to the encoded input image
        # (diffusers' LTX2ImageToVideoPipeline): a request with `input_reference` runs it.
        tasks=frozenset({"t2v", "i2v"}),
        defaults=SamplingDefaults(
            width=768, height=512, num_frames=121, num_inference_steps=30, guidance_scale=3.0, fps=24
        ),
        profile=LTX2_PROFILE,
        layer_containers=LTX2_LAYERS,
        # diffusers' LTX2Pipeline checks sizes against 32 whatever the VAE (`check_inputs`); the native adapter keeps
        # its rule (the published VAE compresses 32x with patch 1, so it is also the latent grid's).
        size_multiple=32,
        max_image_inputs=1,
        native_adapter="diffuserve.families.ltx2.adapter:LTX2Adapter",
        required_components=(
            "transformer",
            "vae",
            "audio_vae",
            "text_encoder",
            "tokenizer",
            "connectors",
            "vocoder",
            "scheduler",
        ),
        lora_loader="LTX2LoraLoaderMixin",
        produces_audio=True,
        # Continuous: a request's audio length follows its own fps (diffusers: round(num_frames / fps x
        # sample_rate / hop / 4) audio latents) and generate_audio decides whether audio tokens exist at all, so
        # both join the continuous group key; the guidance reads each row's own sigma (`step_extras`). Request-
        # level batches merge any rows: the adapter runs rows of different audio lengths as one call per length.
        supports_continuous=True,
        continuous_key_fields=("fps", "generate_audio"),
        text_encoder_keys=("text_encoder",),
        tiny_builds={
            "ltx2": "diffuserve.families.ltx2.tiny:build_ltx2",
            "ltx2.3": "diffuserve.families.ltx2.tiny:build_ltx23",
        },
    ),
)
