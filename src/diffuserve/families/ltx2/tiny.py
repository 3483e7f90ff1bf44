"""The tiny LTX-2 checkpoint (`make-tiny --family ltx2`): Gemma3 into the text connectors, the joint audio-video
transformer, the video VAE, the audio VAE and the vocoder, in the exact diffusers layout.

Random weights over real configs scaled down, an offline tokenizer with a small vocabulary, one fixed seed per
component (so two builds write the same bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.families.video_others.tiny import _sentencepiece_vocab
from diffuserve.models.tiny import write_defaults

SEED = 900
"""Base seed of the components (shared with `families/video_others/tiny.py`, whose range it was built in: the
bytes of the checkpoint did not change when it moved here)."""

LTX2_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 9, "num_inference_steps": 2, "fps": 8}
"""What the tiny LTX-2 checkpoint suggests (its one-level VAE compresses time 2x: 2k+1 frames; the published
one compresses 8x). Sizes are multiples of 32, the pipeline's own check."""


CAPTION_WIDTH = 32
"""LTX-2.0's connectors emit 4 heads x 8 = 32 features: the transformer's caption width."""


def _connectors(text_layers: int, text_hidden: int, *, ltx23: bool) -> Any:
    """The text connectors; LTX-2.3's emit the transformer's own widths (video 2 x 8, audio 2 x 4) from
    per-modality projections, with 8 learnable registers each."""
    import torch
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    video_heads, video_dim, audio_heads, audio_dim = (2, 8, 2, 4) if ltx23 else (4, 8, 4, 8)
    connector_23 = (
        {"per_modality_projections": True, "video_hidden_dim": 16, "audio_hidden_dim": 8, "proj_bias": True}
        if ltx23
        else {}
    )
    torch.manual_seed(SEED + 22)
    return LTX2TextConnectors(
        caption_channels=text_hidden,
        text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=video_heads,
        video_connector_attention_head_dim=video_dim,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8 if ltx23 else None,
        audio_connector_num_attention_heads=audio_heads,
        audio_connector_attention_head_dim=audio_dim,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8 if ltx23 else None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
        **connector_23,
    ).eval()


def _transformer(*, ltx23: bool) -> Any:
    """The joint audio-video transformer (2 blocks); LTX-2.3's settings where `ltx23`."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    transformer_23 = (
        {
            "gated_attn": True,
            "cross_attn_mod": True,
            "audio_gated_attn": True,
            "audio_cross_attn_mod": True,
            "use_prompt_embeddings": False,
            "perturbed_attn": True,
        }
        if ltx23
        else {}
    )
    torch.manual_seed(SEED + 23)
    return LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=CAPTION_WIDTH,
        rope_double_precision=False,
        rope_type="split",
        **transformer_23,
    ).eval()


def _tiny_gemma3(tokenizer: Any, vocab: dict[str, int], text_layers: int, text_hidden: int) -> Any:
    """LTX-2's tiny Gemma3 text encoder (every hidden state is read), from its fixed seed."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(SEED + 21)
    gemma = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": text_hidden,
                "intermediate_size": 32,
                "num_hidden_layers": text_layers,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "max_position_embeddings": 2048,
                "sliding_window": 64,
                "pad_token_id": tokenizer.pad_token_id,
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 16,
                "patch_size": 8,
            },
            mm_tokens_per_image=4,
            boi_token_index=vocab["<start_of_image>"],
            eoi_token_index=vocab["<end_of_image>"],
            image_token_index=vocab["<image_soft_token>"],
        )
    ).eval()
    return gemma


def _ltx2_decoders() -> tuple[Any, Any, Any]:
    """LTX-2's tiny video VAE, audio VAE and vocoder, each from its fixed seed."""
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(SEED + 24)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    torch.manual_seed(SEED + 25)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    ).eval()
    torch.manual_seed(SEED + 26)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        out_channels=2,
        # x80 over the audio VAE's 100 mel frames a second (16 kHz, hop 160): a real 8 kHz waveform, so a clip's
        # sound lasts as long as its video (the published vocoder: x240 to 24 kHz).
        upsample_kernel_sizes=[16, 20],
        upsample_factors=[8, 10],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=8000,
    ).eval()
    return vae, audio_vae, vocoder


def build_ltx2(output_dir: Path) -> None:
    """LTX-2 text-to-audio+video layout: Gemma3 encoder (all hidden states) into the text connectors (text hidden
    = connector heads x head dim), the audio-video transformer, the video VAE, the audio VAE and the vocoder."""
    _build(output_dir, ltx23=False)


def build_ltx23(output_dir: Path) -> None:
    """The LTX-2.3 settings of the same classes: per-modality text projections with learnable registers in the
    connectors (they fill the padding), gated attention, cross-attention modulation, the perturbable self-attention
    and no caption projection (the connectors emit the transformer's own widths)."""
    _build(output_dir, ltx23=True)


def _build(output_dir: Path, *, ltx23: bool) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from transformers import GemmaTokenizer

    vocab, merges = _sentencepiece_vocab(
        ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    )
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, padding_side="left")
    text_layers, text_hidden = 2, 32
    gemma = _tiny_gemma3(tokenizer, vocab, text_layers, text_hidden)  # seed SEED + 21
    connectors = _connectors(text_layers, text_hidden, ltx23=ltx23)  # seed SEED + 22
    transformer = _transformer(ltx23=ltx23)  # seed SEED + 23
    vae, audio_vae, vocoder = _ltx2_decoders()  # seeds SEED + 24, 25, 26
    LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=gemma,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    ).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, LTX2_TINY_DEFAULTS)
