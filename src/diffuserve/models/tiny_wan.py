"""Tiny Wan2.2 checkpoints: A14B (two experts) and TI2V-5B (48-channel VAE, per-token timesteps).

Built offline with the tiny Wan2.1 parts of `models/tiny.py` (UMT5 encoder, offline tokenizer, 3D transformer),
fixed seeds per component, so two builds write the same bytes.
"""

from __future__ import annotations

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
