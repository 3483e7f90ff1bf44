"""Tiny Wan checkpoints: Wan2.1 T2V, Wan2.2 A14B (two experts), TI2V-5B (48-channel VAE, per-token timesteps)
and I2V.

Built offline from the tiny Wan2.1 parts below (UMT5 encoder with the offline tokenizer of `models/tiny.py`, 3D
transformer, causal video VAE), fixed seeds per component, so two builds write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffuserve.models.tiny import PRESETS, TinyFluxPreset, build_tokenizers, write_defaults
from diffuserve.models.tiny_parts import tiny_t5_config

WAN_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4, "fps": 8}
"""What the tiny Wan2.1 checkpoint suggests: small enough that a video job takes well under a second."""


def _build_wan_components(preset: TinyFluxPreset) -> dict[str, Any]:
    """A tiny Wan2.1 text-to-video layout (UMT5 encoder, 3D transformer, causal video VAE, UniPC).

    The shapes follow the real Wan2.1 T2V checkpoint scaled down: patch (1, 2, 2) over a VAE with
    8x spatial and 4x temporal compression, so sizes are multiples of 16 and frame counts are 4k+1.
    """
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    _, t5_tok = build_tokenizers()
    h = preset.text_hidden
    z_dim = preset.latent_channels
    torch.manual_seed(preset.seed + 21)
    text_encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_config(t5_tok, h))).eval()
    torch.manual_seed(preset.seed + 22)
    # head dim 12 splits into RoPE axes (t, h, w) = (4, 4, 4), as 128 splits into (44, 42, 42) upstream.
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=z_dim,
        out_channels=z_dim,
        text_dim=h,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    torch.manual_seed(preset.seed + 23)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    ).eval()
    # The scheduler of the published Wan2.1 T2V checkpoints: UniPC over flow-matching sigmas.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    return {
        "tokenizer": t5_tok,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": scheduler,
        "transformer": transformer,
    }


def build_wan(output_dir: Path) -> None:
    """A tiny Wan2.1 text-to-video checkpoint that suggests its own small defaults."""
    from diffusers import WanPipeline

    WanPipeline(**_build_wan_components(PRESETS["tiny"])).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, WAN_TINY_DEFAULTS)


A14B_BOUNDARY_RATIO = 0.875
"""The published Wan2.2 T2V A14B switches experts at 87.5% of the train timesteps."""


def build_wan22_a14b(output_dir: Path) -> None:
    """Wan2.2 T2V A14B layout: `transformer` (high noise) + `transformer_2` (low noise), `boundary_ratio`."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    parts = _build_wan_components(PRESETS["tiny"])
    torch.manual_seed(PRESETS["tiny"].seed + 24)
    parts["transformer_2"] = WanTransformer3DModel.from_config(parts["transformer"].config).eval()
    WanPipeline(**parts, boundary_ratio=A14B_BOUNDARY_RATIO).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, WAN_TINY_DEFAULTS)


def build_wan22_ti2v(output_dir: Path) -> None:
    """Wan2.2 TI2V-5B layout: a 48-channel residual VAE with 2x2 pixel patches (16x spatial compression) and
    `expand_timesteps` (one timestep per latent token)."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    parts = _build_wan_components(PRESETS["tiny"])
    z_dim = 48
    torch.manual_seed(PRESETS["tiny"].seed + 25)
    parts["vae"] = AutoencoderKLWan(
        base_dim=16,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        scale_factor_spatial=16,
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    ).eval()
    torch.manual_seed(PRESETS["tiny"].seed + 26)
    config = dict(parts["transformer"].config)
    config.update(in_channels=z_dim, out_channels=z_dim)
    parts["transformer"] = WanTransformer3DModel.from_config(config).eval()
    WanPipeline(**parts, expand_timesteps=True).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, WAN_TINY_DEFAULTS)


def build_wan_i2v(output_dir: Path) -> None:
    """Wan2.1 I2V layout: a CLIP vision encoder (penultimate hidden states as image tokens) and a transformer
    that takes the noise, a 4-channel first-frame mask and the VAE-encoded conditioning video (z + 4 + z)."""
    import torch
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = _build_wan_components(PRESETS["tiny"])
    z_dim = parts["vae"].config.z_dim
    torch.manual_seed(PRESETS["tiny"].seed + 27)
    vision = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    ).eval()
    config = dict(parts["transformer"].config)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    config.update(in_channels=2 * z_dim + 4, out_channels=z_dim, image_dim=16, added_kv_proj_dim=inner)
    torch.manual_seed(PRESETS["tiny"].seed + 28)
    parts["transformer"] = WanTransformer3DModel.from_config(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    WanImageToVideoPipeline(**parts, image_encoder=vision, image_processor=processor).save_pretrained(
        output_dir, safe_serialization=True
    )
    # Without torchvision transformers saves its PIL fallback class; name the upstream class (which loads
    # the same preprocessor_config.json, falling back to the PIL class where torchvision is missing).
    index_file = output_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_defaults(output_dir, WAN_TINY_DEFAULTS)
