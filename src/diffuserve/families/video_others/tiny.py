"""Tiny checkpoints of the video families served through the diffusers backend: HunyuanVideo (Llama + CLIP),
LTX-2 (Gemma3, text connectors, audio VAE and vocoder) and Helios (UMT5, Wan VAE, chunked denoising).

Random weights over real configs scaled down, offline tokenizers with small vocabularies, one fixed seed per
component (so two builds write the same bytes), saved in the exact diffusers layout. Each suggests small request
defaults (`write_defaults`) so a video job on CPU takes about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.models.tiny import (
    _BIGRAMS,
    _tiny_clip_config,
    _tiny_t5_config,
    build_tokenizers,
    write_defaults,
)

SEED = 900
"""Base seed of this module's components (other tiny modules use other ranges)."""

HUNYUAN_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
"""What the tiny HunyuanVideo checkpoints suggest (4k+1 frames: the VAE compresses time 4x)."""

LTX2_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 9, "num_inference_steps": 2, "fps": 8}
"""What the tiny LTX-2 checkpoint suggests (its one-level VAE compresses time 2x: 2k+1 frames; the published
one compresses 8x). Sizes are multiples of 32, the pipeline's own check."""

HELIOS_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 33, "num_inference_steps": 2, "fps": 8}
"""What the tiny Helios checkpoint suggests. Helios denoises in chunks of (num_latent_frames_per_chunk - 1) x 4
+ 1 = 33 frames, so any count up to 33 gives one 33-frame chunk (diffusers' behaviour, kept unmodified): the
default asks for exactly what comes back."""


def _sentencepiece_vocab(specials: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small SentencePiece-style BPE vocabulary (byte fallback, `▁` word starts, some bigram merges) for the
    Llama and Gemma tokenizers: every string encodes, and different prompts give different ids."""
    tokens = list(specials) + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]
    merges: list[tuple[str, str]] = []
    for pair in _BIGRAMS:
        merges.append((pair[0], pair[1]))
        tokens.append(pair)
    for letter in "abcdefghijklmnopqrstuvwxyz":
        merges.append(("▁", letter))
        tokens.append("▁" + letter)
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}, merges


def build_hunyuan_video(output_dir: Path) -> None:
    """HunyuanVideo T2V layout: Llama text encoder (hidden states), CLIP pooled text, the dual/single-stream 3D
    transformer with embedded guidance, the causal 3D VAE (8x space, 4x time)."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel, LlamaTokenizer

    clip_tok, _ = build_tokenizers()
    vocab, merges = _sentencepiece_vocab(["<unk>", "<s>", "</s>", "<pad>"])
    llama_tok = LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<pad>")
    torch.manual_seed(SEED + 1)
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=len(llama_tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=llama_tok.bos_token_id,
            eos_token_id=llama_tok.eos_token_id,
            pad_token_id=llama_tok.pad_token_id,
        )
    ).eval()
    torch.manual_seed(SEED + 2)
    clip = CLIPTextModel(CLIPTextConfig(**_tiny_clip_config(clip_tok, 8))).eval()
    torch.manual_seed(SEED + 3)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    ).eval()
    torch.manual_seed(SEED + 4)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    HunyuanVideoPipeline(
        text_encoder=llama,
        tokenizer=llama_tok,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder_2=clip,
        tokenizer_2=clip_tok,
    ).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, HUNYUAN_TINY_DEFAULTS)


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
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    ).eval()
    return vae, audio_vae, vocoder


def build_ltx2(output_dir: Path) -> None:
    """LTX-2 text-to-audio+video layout: Gemma3 encoder (all hidden states) into the text connectors (text hidden
    = connector heads x head dim), the audio-video transformer, the video VAE, the audio VAE and the vocoder."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import GemmaTokenizer

    vocab, merges = _sentencepiece_vocab(
        ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    )
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, padding_side="left")
    text_layers, text_hidden = 2, 32
    gemma = _tiny_gemma3(tokenizer, vocab, text_layers, text_hidden)  # seed SEED + 21
    heads, head_dim = 4, 8  # the connectors emit heads x head_dim = 32 features: the transformer's caption width
    torch.manual_seed(SEED + 22)
    connectors = LTX2TextConnectors(
        caption_channels=text_hidden,
        text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=heads,
        video_connector_attention_head_dim=head_dim,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=heads,
        audio_connector_attention_head_dim=head_dim,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
    torch.manual_seed(SEED + 23)
    transformer = LTX2VideoTransformer3DModel(
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
        caption_channels=heads * head_dim,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
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


def build_helios(output_dir: Path) -> None:
    """Helios layout: UMT5 encoder, the Helios 3D transformer (multi-term memory patches, guidance cross-attention),
    the Wan VAE and the one-stage Helios scheduler."""
    import torch
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosScheduler, HeliosTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    _, t5_tok = build_tokenizers(t5_max_length=64)
    torch.manual_seed(SEED + 31)
    text_encoder = UMT5EncoderModel(UMT5Config(**_tiny_t5_config(t5_tok, 32))).eval()
    torch.manual_seed(SEED + 32)
    transformer = HeliosTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_dim=(4, 4, 4),
        has_multi_term_memory_patch=True,
        guidance_cross_attn=True,
        zero_history_timestep=True,
        is_amplify_history=False,
    ).eval()
    torch.manual_seed(SEED + 33)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()
    scheduler = HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True)
    HeliosPipeline(
        tokenizer=t5_tok, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    ).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, HELIOS_TINY_DEFAULTS)
