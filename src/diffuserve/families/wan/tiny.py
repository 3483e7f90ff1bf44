"""Tiny Wan2.2 checkpoints: A14B (two experts) and TI2V-5B (48-channel VAE, per-token timesteps).

Built offline with the tiny Wan2.1 parts of `models/tiny.py` (UMT5 encoder, offline tokenizer, 3D transformer),
fixed seeds per component, so two builds write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffuserve.models.tiny import PRESETS, WAN_TINY_DEFAULTS, _build_wan_components, write_defaults

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
        base_dim=16, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
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
    vision = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=32, patch_size=8)).eval()
    config = dict(parts["transformer"].config)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    config.update(in_channels=2 * z_dim + 4, out_channels=z_dim, image_dim=16, added_kv_proj_dim=inner)
    torch.manual_seed(PRESETS["tiny"].seed + 28)
    parts["transformer"] = WanTransformer3DModel.from_config(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    WanImageToVideoPipeline(**parts, image_encoder=vision, image_processor=processor).save_pretrained(
        output_dir, safe_serialization=True)
    # Without torchvision transformers saves its PIL fallback class; name the upstream class (which loads
    # the same preprocessor_config.json, falling back to the PIL class where torchvision is missing).
    index_file = output_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_defaults(output_dir, WAN_TINY_DEFAULTS)
