"""The tiny FLUX.1-style checkpoints: `tiny` (~72k-parameter transformer, the test model) and `36m` (benchmarks).

Built offline from in-code configs and the offline tokenizers of `models/tiny.py`, fixed seeds, so two builds write
the same bytes. (The embedded default model is the trained demo checkpoint, `models/tiny.py` `DEMO_CHECKPOINT`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError
from diffuserve.models.tiny import PRESETS, TinyFluxPreset, build_tokenizers
from diffuserve.models.tiny_parts import tiny_clip_config, tiny_t5_config

TINY_FLUX_T5_LENGTH = 64
"""T5 tokens per prompt the tiny FLUX checkpoints declare (tokenizer_2 `model_max_length`).

Real FLUX.1 declares 512. A tiny model with 512 text tokens beside 16 image tokens spends nearly all
its time on the text stream, which is not the overhead-bound regime a tiny serving model stands for;
64 tokens still hold every prompt the tests use."""


def _build_flux_components(preset: TinyFluxPreset) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if sum(preset.axes_dims_rope) != preset.attention_head_dim:
        raise ConfigError(
            f"tiny preset: sum(axes_dims_rope)={sum(preset.axes_dims_rope)} must equal "
            f"attention_head_dim={preset.attention_head_dim}."
        )
    clip_tok, t5_tok = build_tokenizers(TINY_FLUX_T5_LENGTH)
    h = preset.text_hidden

    # Each model gets its own fixed seed so that changing one component leaves the others' bytes alone.
    torch.manual_seed(preset.seed + 1)
    clip = CLIPTextModel(CLIPTextConfig(**tiny_clip_config(clip_tok, h)))
    torch.manual_seed(preset.seed + 2)
    t5 = T5EncoderModel(T5Config(**tiny_t5_config(t5_tok, h)))
    torch.manual_seed(preset.seed + 3)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=preset.latent_channels * 4,
        num_layers=preset.num_layers,
        num_single_layers=preset.num_single_layers,
        attention_head_dim=preset.attention_head_dim,
        num_attention_heads=preset.num_attention_heads,
        joint_attention_dim=h,
        pooled_projection_dim=h,
        guidance_embeds=preset.guidance_embeds,
        axes_dims_rope=preset.axes_dims_rope,
    )
    torch.manual_seed(preset.seed + 4)
    levels = len(preset.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=preset.vae_channels,
        layers_per_block=1,
        latent_channels=preset.latent_channels,
        norm_num_groups=4,
        sample_size=preset.sample_size,
        scaling_factor=1.5035,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # The shift settings of FLUX.1-dev; they make `mu` depend on the image token count as upstream.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return {
        "scheduler": scheduler,
        "vae": vae.eval(),
        "text_encoder": clip.eval(),
        "tokenizer": clip_tok,
        "text_encoder_2": t5.eval(),
        "tokenizer_2": t5_tok,
        "transformer": transformer.eval(),
    }


def build_flux(output_dir: Path, preset: str = "tiny") -> None:
    """The tiny FLUX.1-style checkpoint (`preset` tiny: the embedded default; 36m: for benchmarks)."""
    from diffusers import FluxPipeline

    FluxPipeline(**_build_flux_components(PRESETS[preset])).save_pretrained(output_dir, safe_serialization=True)


def build_flux_fill(output_dir: Path) -> None:
    """A tiny FLUX.1 Fill checkpoint (`FluxFillPipeline`): the tiny FLUX.1 whose transformer input is widened as
    FLUX.1-Fill-dev's is: packed latents, packed masked-image latents and the packed f x f mask (C*4 + C*4 + f*f*4
    channels for C latent channels and VAE factor f), its output the packed latents (C*4)."""
    import torch
    from diffusers import FluxFillPipeline, FluxTransformer2DModel

    preset = PRESETS["tiny"]
    parts = _build_flux_components(preset)
    c, f = preset.latent_channels, 2 ** (len(preset.vae_channels) - 1)
    config = {k: v for k, v in parts["transformer"].config.items() if not k.startswith("_")}
    torch.manual_seed(preset.seed + 5)
    parts["transformer"] = FluxTransformer2DModel(**{**config, "in_channels": c * 8 + f * f * 4, "out_channels": c * 4})
    FluxFillPipeline(**parts).save_pretrained(output_dir, safe_serialization=True)
