"""Tiny checkpoints of the video families served through the diffusers backend: HunyuanVideo (Llama + CLIP),
Helios (UMT5, Wan VAE, chunked denoising). (HunyuanVideo 1.5's and LTX-2's builders are native beside their
families: `families/hunyuan_video15/tiny.py`, `families/ltx2/tiny.py`.)

Random weights over real configs scaled down, offline tokenizers with small vocabularies, one fixed seed per
component (so two builds write the same bytes), saved in the exact diffusers layout. Each suggests small request
defaults (`write_defaults`) so a video job on CPU takes about a second.
"""

from __future__ import annotations

from pathlib import Path

from diffuserve.models.tiny import build_tokenizers, write_defaults
from diffuserve.models.tiny_parts import sentencepiece_vocab, tiny_clip_config, tiny_t5_config

_sentencepiece_vocab = sentencepiece_vocab
"""The name families/ltx2/tiny.py still imports (its builder moves to `models.tiny_parts.sentencepiece_vocab`)."""

SEED = 900
"""Base seed of this module's components (other tiny modules use other ranges)."""

HUNYUAN_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
"""What the tiny HunyuanVideo checkpoints suggest (4k+1 frames: the VAE compresses time 4x)."""

HELIOS_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 33, "num_inference_steps": 2, "fps": 8}
"""What the tiny Helios checkpoint suggests. Helios denoises in chunks of (num_latent_frames_per_chunk - 1) x 4
+ 1 = 33 frames, so any count up to 33 gives one 33-frame chunk (diffusers' behaviour, kept unmodified): the
default asks for exactly what comes back."""


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
    vocab, merges = sentencepiece_vocab(["<unk>", "<s>", "</s>", "<pad>"])
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
    clip = CLIPTextModel(CLIPTextConfig(**tiny_clip_config(clip_tok, 8))).eval()
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


def build_helios(output_dir: Path) -> None:
    """Helios layout: UMT5 encoder, the Helios 3D transformer (multi-term memory patches, guidance cross-attention),
    the Wan VAE and the one-stage Helios scheduler."""
    import torch
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosScheduler, HeliosTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    _, t5_tok = build_tokenizers(t5_max_length=64)
    torch.manual_seed(SEED + 31)
    text_encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_config(t5_tok, 32))).eval()
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
