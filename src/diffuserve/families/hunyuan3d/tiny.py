"""Tiny random-weight Hunyuan3D-2 releases in Tencent's exact layout (`make-tiny --family hunyuan3d`).

`<root>/hunyuan3d-dit-v2-{0,0-fast,0-turbo,mini}/config.yaml` + `model.fp16.safetensors` (keys prefixed `model.`,
`vae.`, `conditioner.`), with `target` paths naming the reference's classes so the reference package loads
the same folder. Consistency: DiT in_channels = VAE embed_dim, context_in_dim = DINOv2 hidden size,
sum(axes_dim) = hidden / heads, DINOv2 image size a multiple of 14. Same bytes on every build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DINO = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "mlp_ratio": 4,
    "image_size": 28,
    "patch_size": 14,
    "num_channels": 3,
    "layerscale_value": 1.0,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
    "qkv_bias": True,
    "use_swiglu_ffn": False,
    "drop_path_rate": 0.0,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.02,
    "model_type": "dinov2",
}

SCALE_FACTOR = 0.9990943042622529
"""The published VAE's latent scale factor (kept so the tiny model exercises the division)."""

TINY_DEFAULTS = {"num_inference_steps": 2, "guidance_scale": 5.0, "octree_resolution": 32}
"""`diffuserve:` section of a tiny config.yaml: request defaults that keep a CPU run near a second."""


def tiny_config(*, guidance_embed: bool = False, consistency: bool = False) -> dict[str, Any]:
    """config.yaml of one tiny shape model (sections as Tencent's, plus diffuserve's own defaults)."""
    scheduler = (
        {
            "target": "hy3dgen.shapegen.schedulers.ConsistencyFlowMatchEulerDiscreteScheduler",
            "params": {"num_train_timesteps": 1000, "pcm_timesteps": 100},
        }
        if consistency
        else {
            "target": "hy3dgen.shapegen.schedulers.FlowMatchEulerDiscreteScheduler",
            "params": {"num_train_timesteps": 1000},
        }
    )
    return {
        "model": {
            "target": "hy3dgen.shapegen.models.Hunyuan3DDiT",
            "params": {
                "in_channels": 8,
                "context_in_dim": DINO["hidden_size"],
                "hidden_size": 32,
                "mlp_ratio": 2.0,
                "num_heads": 2,
                "depth": 1,
                "depth_single_blocks": 2,
                "axes_dim": [16],
                "theta": 10000,
                "qkv_bias": True,
                "guidance_embed": guidance_embed,
            },
        },
        "vae": {
            "target": "hy3dgen.shapegen.models.ShapeVAE",
            "params": {
                "num_latents": 16,
                "embed_dim": 8,
                "width": 32,
                "heads": 2,
                "num_decoder_layers": 1,
                "num_freqs": 4,
                "include_pi": False,
                "qkv_bias": False,
                "qk_norm": True,
                "scale_factor": SCALE_FACTOR,
            },
        },
        "conditioner": {
            "target": "hy3dgen.shapegen.models.SingleImageEncoder",
            "params": {
                "main_image_encoder": {
                    "type": "DinoImageEncoder",
                    "kwargs": {"config": dict(DINO), "image_size": 28, "use_cls_token": True},
                }
            },
        },
        "scheduler": scheduler,
        "image_processor": {
            "target": "hy3dgen.shapegen.preprocessors.ImageProcessorV2",
            "params": {"size": 64, "border_ratio": 0.15},
        },
        "diffuserve": dict(TINY_DEFAULTS),
    }


def write_shape_model(folder: Path, config: dict[str, Any], seed: int) -> None:
    """Build the modules from `config` with seeded random weights and write the folder."""
    import torch
    import yaml
    from safetensors.torch import save_file

    from diffuserve.families.hunyuan3d.conditioning import DinoConditioner
    from diffuserve.families.hunyuan3d.dit import Hunyuan3DDiT
    from diffuserve.families.hunyuan3d.vae import ShapeVAE

    torch.manual_seed(seed)
    modules = {
        "model": Hunyuan3DDiT(**config["model"]["params"]),
        "vae": ShapeVAE(**config["vae"]["params"]),
        "conditioner": DinoConditioner(**config["conditioner"]["params"]),
    }
    # Random LayerNorm/RMSNorm scales and zero-centred output bias, so the tiny volume has a surface to find.
    tensors: dict[str, torch.Tensor] = {}
    for prefix, module in modules.items():
        for key, value in module.state_dict().items():
            value = value.clone()
            if value.dim() == 1 and key.endswith(("scale", "weight")) and torch.all(value == 1):
                value = 1 + 0.1 * torch.randn_like(value)
            tensors[f"{prefix}.{key}"] = value.to(torch.float16).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=True))
    save_file(tensors, str(folder / "model.fp16.safetensors"))


def build_hunyuan3d(output_dir: Path) -> None:
    """A tiny Hunyuan3D-2 release: the 2.0 model and its fast (guidance embedding) and turbo (guidance
    embedding + consistency scheduler) variants, each in its own subfolder."""
    write_shape_model(output_dir / "hunyuan3d-dit-v2-0", tiny_config(), seed=0)
    write_shape_model(output_dir / "hunyuan3d-dit-v2-0-fast", tiny_config(guidance_embed=True), seed=1)
    write_shape_model(
        output_dir / "hunyuan3d-dit-v2-0-turbo", tiny_config(guidance_embed=True, consistency=True), seed=2
    )
    # 2mini is its own release (Hunyuan3D-2mini) upstream; here a fourth subfolder, picked by `--model-id ...mini`.
    write_shape_model(output_dir / "hunyuan3d-dit-v2-mini", tiny_config(), seed=3)
