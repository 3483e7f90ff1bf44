"""FLUX.1 ControlNet rows (FluxControlNetModel, incl. ControlNet-Union): diffusers' `FluxControlNetPipeline` per row.

`prepare_control_latents` encodes each request's control image with the VAE (sampled with the row's generator
before its noise, as the pipeline does) and packs it; `controlnet_kwargs` runs each ControlNet on its rows at one
denoiser call and gives the DiT its residuals (`pipelines/controlnet.py` groups, scatters and reuses them).
`build_tiny_flux_controlnet` writes a tiny ControlNet in the real layout for a tiny FLUX.1 checkpoint.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from diffuserve.pipelines import controlnet as rows_of
from diffuserve.pipelines.batch_rows import row_seeds
from diffuserve.pipelines.controlnet import ControlRow


def prepare_control_latents(
    pipe: Any, batch: Sequence[Any], height: int, width: int, positive: dict[str, torch.Tensor], timesteps: torch.Tensor
) -> tuple[torch.Tensor, list[ControlRow | None]]:
    """Packed initial noise and each row's ControlNet conditioning. A request with a control image samples its
    image latents from its row generators first, then its noise (FluxControlNetPipeline's order); a plain
    request's noise is drawn exactly as `prepare_latents` draws it."""
    lh, lw = pipe._latent_hw(height, width)
    channels = pipe.transformer.config.in_channels // 4
    noise_rows: list[torch.Tensor] = []
    control: list[ControlRow | None] = []
    first = 0
    for params in batch:
        generators = [torch.Generator("cpu").manual_seed(s) for s in row_seeds(params)]
        if params.control is not None:
            cond = _control_latents(pipe, params, height, width, generators)
            net = rows_of.requested_net(params, pipe.recipe.controlnets)
            c = params.control
            for j in range(params.n):
                text = {k: positive[k][first + j : first + j + 1] for k in ("pooled", "prompt_embeds")}
                control.append(
                    ControlRow(
                        net, cond[j : j + 1], c.mode, c.scale, c.start, c.end, timesteps, params.guidance_scale, text
                    )
                )
        else:
            control.extend([None] * params.n)
        first += params.n
        noise_rows.append(
            randn_tensor((params.n, channels, lh, lw), generator=generators, device=pipe.device, dtype=pipe.dtype)
        )
    noise = torch.cat(noise_rows)
    return FluxPipeline._pack_latents(noise, noise.shape[0], channels, lh, lw), control


def _control_latents(
    pipe: Any, params: Any, height: int, width: int, generators: list[torch.Generator]
) -> torch.Tensor:
    """The request's control image resized to the output (the pipeline's `prepare_image`), VAE-encoded, sampled
    per row (`retrieve_latents` with the row generators), shifted, scaled and packed: (n, tokens, 4 x channels)."""
    image = Image.open(io.BytesIO(params.control.image)).convert("RGB")
    pixels = pipe.image_processor.preprocess(image, height=height, width=width).to(torch.float32)
    vae = pipe.vae
    with pipe.recipe.component_scope(pipe.decoder):
        dist = vae.encode(pixels.to(pipe.device, vae.dtype)).latent_dist
    shape = (params.n, *dist.mean.shape[1:])
    sample = randn_tensor(shape, generator=generators, device=dist.mean.device, dtype=dist.mean.dtype)
    latents = dist.mean.expand(shape) + dist.std.expand(shape) * sample
    latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    channels, lh, lw = latents.shape[1:]
    return FluxPipeline._pack_latents(latents, params.n, channels, lh, lw).to(pipe.dtype)


def controlnet_kwargs(
    pipe: Any, latents: torch.Tensor, timestep: torch.Tensor, extras: dict[str, Any]
) -> dict[str, Any]:
    """The FLUX.1 DiT's `controlnet_block_samples` / `controlnet_single_block_samples` for this call ({} when no row
    has an active ControlNet)."""

    def compute(x: torch.Tensor, t: torch.Tensor) -> dict[str, Any]:
        rows = rows_of.control_rows(extras) or []
        groups = rows_of.active_groups(rows, t)
        if not groups:
            return {}
        outputs = []
        for net, index, scales in groups.values():
            blocks, singles = _run(pipe, net, [rows[i] for i in index], x[index], t[index], scales, extras)
            outputs.append((net, index, blocks, singles))
        if len(outputs) == 1 and outputs[0][1] == list(range(x.shape[0])):
            net, _, blocks, singles = outputs[0]
            return {
                "controlnet_block_samples": blocks,
                "controlnet_single_block_samples": singles,
                "controlnet_blocks_repeat": net.model.input_hint_block is not None,
            }
        num_blocks = len(pipe.transformer.transformer_blocks)
        num_singles = len(pipe.transformer.single_transformer_blocks)
        acc_blocks, acc_singles = None, None
        for net, index, blocks, singles in outputs:
            repeat = net.model.input_hint_block is not None
            acc_blocks = rows_of.add_blocks(
                acc_blocks, rows_of.per_block(rows_of.scatter(blocks, index, x.shape[0]), num_blocks, repeat)
            )
            acc_singles = rows_of.add_blocks(
                acc_singles, rows_of.per_block(rows_of.scatter(singles, index, x.shape[0]), num_singles, False)
            )
        return {"controlnet_block_samples": acc_blocks, "controlnet_single_block_samples": acc_singles}

    return rows_of.step_residuals(extras, latents, timestep, compute)


def _run(
    pipe: Any,
    net: Any,
    rows: list[ControlRow],
    latents: torch.Tensor,
    timestep: torch.Tensor,
    scales: list[float],
    extras: dict[str, Any],
) -> tuple[Any, Any]:
    """One ControlNet call on its rows (FluxControlNetPipeline's call, with a per-row conditioning scale)."""
    model = net.model
    mode = None
    if net.num_modes is not None:
        mode = torch.tensor([[r.mode] for r in rows], device=latents.device, dtype=torch.long)
    guidance = None
    if model.config.guidance_embeds:
        guidance = torch.tensor([r.guidance for r in rows], device=latents.device, dtype=torch.float32)
    scale = torch.tensor(scales, device=latents.device, dtype=latents.dtype).view(-1, 1, 1)
    with pipe.recipe.component_scope(net.key):
        return model(
            hidden_states=latents,
            controlnet_cond=torch.cat([r.cond for r in rows]),
            controlnet_mode=mode,
            conditioning_scale=scale,
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=guidance,
            pooled_projections=torch.cat([r.text["pooled"] for r in rows]),
            encoder_hidden_states=torch.cat([r.text["prompt_embeds"] for r in rows]),
            txt_ids=extras["txt_ids"],
            img_ids=extras["img_ids"],
            return_dict=False,
        )


def build_tiny_flux_controlnet(
    checkpoint: Path, output: Path, *, num_modes: int | None = None, seed: int = 0, num_layers: int = 1
) -> Path:
    """A tiny FluxControlNetModel (ControlNet-Union with `num_modes`) for the tiny FLUX.1 checkpoint at
    `checkpoint`, in diffusers' layout (`save_pretrained`): random weights, with the zero-initialised output
    projections given random values so its residuals change the image (a fresh ControlNet adds nothing)."""
    import json

    from diffusers import FluxControlNetModel

    config = json.loads((Path(checkpoint) / "transformer" / "config.json").read_text())
    torch.manual_seed(seed)
    model = FluxControlNetModel(
        patch_size=config["patch_size"],
        in_channels=config["in_channels"],
        num_layers=num_layers,
        num_single_layers=1,
        attention_head_dim=config["attention_head_dim"],
        num_attention_heads=config["num_attention_heads"],
        joint_attention_dim=config["joint_attention_dim"],
        pooled_projection_dim=config["pooled_projection_dim"],
        guidance_embeds=config["guidance_embeds"],
        axes_dims_rope=config["axes_dims_rope"],
        num_mode=num_modes,
    )
    with torch.no_grad():
        for module in [*model.controlnet_blocks, *model.controlnet_single_blocks, model.controlnet_x_embedder]:
            torch.nn.init.normal_(module.weight, std=0.3)
            torch.nn.init.normal_(module.bias, std=0.05)
    model.eval().save_pretrained(output, safe_serialization=True)
    return Path(output)
