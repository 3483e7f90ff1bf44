"""Qwen-Image ControlNet rows (QwenImageControlNetModel, incl. InstantX's ControlNet-Union, which takes every control
type through the same weights): diffusers' `QwenImageControlNetPipeline` per row.

As FLUX.1's: the control image is VAE-encoded (the video VAE, one frame) and sampled with the row's generator before
its noise, normalised with the VAE's latents mean / std and packed; the ControlNet sees the positive prompt only (each
row's own tokens, padded within the group with a mask as the DiT's rows are) and both CFG branches add its residuals.
`build_tiny_qwen_image_controlnet` writes a tiny ControlNet in the real layout for a tiny Qwen-Image checkpoint.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from diffuserve.families.qwen_image import ops
from diffuserve.pipelines import controlnet as rows_of
from diffuserve.pipelines.batch_rows import row_seeds
from diffuserve.pipelines.controlnet import ControlRow


def prepare_control_latents(
    pipe: Any, batch: Sequence[Any], height: int, width: int, positive: dict[str, torch.Tensor], timesteps: torch.Tensor
) -> tuple[torch.Tensor, list[ControlRow | None]]:
    """Packed initial noise and each row's ControlNet conditioning (control latents first, then noise, from the
    row's generator; a plain row's noise is drawn as `_noise` draws it)."""
    lh, lw = pipe._latent_hw(height, width)
    channels = pipe.transformer.config.in_channels // 4
    noise_rows: list[torch.Tensor] = []
    control: list[ControlRow | None] = []
    first = 0
    for params in batch:
        generators = [torch.Generator("cpu").manual_seed(s) for s in row_seeds(params)]
        if params.control is not None:
            cond = _control_latents(pipe, params, height, width, generators, channels)
            net = rows_of.requested_net(params, pipe.recipe.controlnets)
            c = params.control
            for j in range(params.n):
                length = int(positive["mask"][first + j].sum())
                text = {"embeds": positive["embeds"][first + j, :length]}
                control.append(
                    ControlRow(
                        net, cond[j : j + 1], None, c.scale, c.start, c.end, timesteps, params.guidance_scale, text
                    )
                )
        else:
            control.extend([None] * params.n)
        first += params.n
        shape = (params.n, 1, channels, lh, lw)
        noise_rows.append(randn_tensor(shape, generator=generators, device=pipe.device, dtype=pipe.dtype))
    noise = torch.cat(noise_rows)
    return QwenImagePipeline._pack_latents(noise, noise.shape[0], channels, lh, lw), control


def _control_latents(
    pipe: Any, params: Any, height: int, width: int, generators: list[torch.Generator], channels: int
) -> torch.Tensor:
    """The pipeline's `prepare_image` + `retrieve_latents(generator)` + normalise + pack, for a request's n rows."""
    image = Image.open(io.BytesIO(params.control.image)).convert("RGB")
    processor = VaeImageProcessor(vae_scale_factor=pipe.vae_scale_factor * 2)  # the pipeline's own
    pixels = processor.preprocess(image, height=height, width=width).to(torch.float32)
    vae = pipe.vae
    with pipe.recipe.component_scope(pipe.decoder):
        dist = vae.encode(pixels.to(pipe.device, vae.dtype).unsqueeze(2)).latent_dist
    shape = (params.n, *dist.mean.shape[1:])
    sample = randn_tensor(shape, generator=generators, device=dist.mean.device, dtype=dist.mean.dtype)
    latents = dist.mean.expand(shape) + dist.std.expand(shape) * sample
    mean, std = ops.latents_stats(vae, latents)
    latents = ((latents - mean) * (1.0 / std)).permute(0, 2, 1, 3, 4)
    packed = QwenImagePipeline._pack_latents(latents, params.n, channels, latents.shape[3], latents.shape[4])
    return packed.to(pipe.dtype)


def controlnet_kwargs(
    pipe: Any, latents: torch.Tensor, timestep: torch.Tensor, extras: dict[str, Any]
) -> dict[str, Any]:
    """The Qwen-Image DiT's `controlnet_block_samples` for this call ({} when no row has an active ControlNet)."""

    def compute(x: torch.Tensor, t: torch.Tensor) -> dict[str, Any]:
        rows = rows_of.control_rows(extras) or []
        groups = rows_of.active_groups(rows, t)
        num_blocks = len(pipe.transformer.transformer_blocks)
        acc = None
        for net, index, scales in groups.values():
            picked = [rows[i] for i in index]
            embeds, mask = ops.pad_rows([r.text["embeds"] for r in picked])
            with pipe.recipe.component_scope(net.key):
                samples = net.model(
                    hidden_states=x[index],
                    controlnet_cond=torch.cat([r.cond for r in picked]),
                    conditioning_scale=torch.tensor(scales, device=x.device, dtype=x.dtype).view(-1, 1, 1),
                    timestep=t[index].to(x.dtype) / 1000,
                    encoder_hidden_states=embeds,
                    encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                    img_shapes=[extras["img_shapes"][0]] * len(index),
                    return_dict=False,
                )
            if len(groups) == 1 and index == list(range(x.shape[0])):
                return {"controlnet_block_samples": samples}
            acc = rows_of.add_blocks(
                acc, rows_of.per_block(rows_of.scatter(samples, index, x.shape[0]), num_blocks, False)
            )
        return {} if acc is None else {"controlnet_block_samples": acc}

    return rows_of.step_residuals(extras, latents, timestep, compute)


def build_tiny_qwen_image_controlnet(checkpoint: Path, output: Path, *, seed: int = 0, num_layers: int = 1) -> Path:
    """A tiny QwenImageControlNetModel for the tiny Qwen-Image checkpoint at `checkpoint` (`save_pretrained`), with
    its zero-initialised projections given random values so its residuals change the image."""
    import json

    from diffusers import QwenImageControlNetModel

    config = json.loads((Path(checkpoint) / "transformer" / "config.json").read_text())
    keys = (
        "patch_size",
        "in_channels",
        "out_channels",
        "attention_head_dim",
        "num_attention_heads",
        "joint_attention_dim",
        "axes_dims_rope",
    )
    torch.manual_seed(seed)
    model = QwenImageControlNetModel(num_layers=num_layers, **{k: config[k] for k in keys if k in config})
    with torch.no_grad():
        for module in [*model.controlnet_blocks, model.controlnet_x_embedder]:
            torch.nn.init.normal_(module.weight, std=0.3)
            torch.nn.init.normal_(module.bias, std=0.05)
    model.eval().save_pretrained(output, safe_serialization=True)
    return Path(output)
