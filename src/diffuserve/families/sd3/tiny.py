"""The tiny Stable Diffusion 3 / 3.5 checkpoint (`diffuserve make-tiny --family sd3`).

The real layout scaled down: two CLIP text encoders with projection (`text_encoder`, `text_encoder_2`),
a T5 encoder (`text_encoder_3`) twice as wide as one CLIP so the concatenated CLIP sequences pad to
its width, an MM-DiT with 2x2 patches and a cropped positional table, an 8x VAE with SD3's latent
scale/shift, and the flow-matching Euler scheduler with SD3's static shift of 3.0. The transformer
carries SD3.5's options (QK RMS-norm, a dual-attention block as in SD3.5 Medium), so the adapter is
checked against the newer variant too.

Random weights with one fixed seed per component, offline tokenizers: the same bytes on every build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_SD3_T5_LENGTH = 64
"""T5 tokens per prompt the tiny checkpoint declares (tokenizer_3 `model_max_length`).

diffusers' SD3 call pads T5 to `max_sequence_length=256`; both diffuserve backends cap that by the
tokenizer's declared length (real SD3 declares 512, so it keeps 256). 64 still holds every test
prompt and keeps the joint attention of a 16-token image small."""

POS_EMBED_MAX_SIZE = 32
"""Side of the transformer's positional table in patches: 32 patches x 2 x VAE 8 = 512 px at most."""


def _text_encoders(clip_tok: Any, t5_tok: Any, clip_hidden: int) -> tuple[list[Any], Any]:
    """The two tiny CLIPs (with projection) and the tiny T5, each from its fixed seed."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    encoders = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        config = CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=clip_hidden,
            intermediate_size=37,
            projection_dim=clip_hidden,
            # Three layers, so the penultimate hidden state SD3 reads (hidden_states[-2]) is a real layer's.
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=77,
            hidden_act="gelu",
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
        encoders.append(CLIPTextModelWithProjection(config).eval())
    torch.manual_seed(13)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=2 * clip_hidden,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
        )
    ).eval()
    return encoders, t5


def build_16ch(output_dir: Path) -> None:
    """The tiny SD3 with SD3's real 16 latent channels: diffusers' StableDiffusion3InpaintPipeline runs only on those
    (it refuses the 4-channel tiny one), so the native inpainting is compared with it on this checkpoint."""
    build(output_dir, latent_channels=16)


def build(output_dir: Path, latent_channels: int = 4) -> None:
    """Write the tiny SD3 checkpoint (diffusers layout, safetensors) into `output_dir`."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from diffuserve.models.tiny import build_tokenizers

    clip_tok, t5_tok = build_tokenizers(TINY_SD3_T5_LENGTH)
    clip_hidden = 32
    encoders, t5 = _text_encoders(clip_tok, t5_tok, clip_hidden)  # seeds 11, 12 (CLIPs) and 13 (T5)
    torch.manual_seed(14)
    transformer = SD3Transformer2DModel(
        sample_size=8,  # latent pixels: 8 x VAE 8 = the 64 px default of diffusers' call
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=2 * clip_hidden,
        caption_projection_dim=32,  # = heads x head dim, as 1536 = 24 x 64 upstream
        pooled_projection_dim=2 * clip_hidden,
        pos_embed_max_size=POS_EMBED_MAX_SIZE,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    ).eval()
    torch.manual_seed(15)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=clip_tok,
        text_encoder_2=encoders[1],
        tokenizer_2=clip_tok,
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
        transformer=transformer,
    )
    pipe.save_pretrained(Path(output_dir), safe_serialization=True)
