"""SD3 / SD3.5 ControlNet rows (SD3ControlNetModel): diffusers' `StableDiffusion3ControlNetPipeline` per row.

Unlike FLUX.1's, the SD3 pipeline runs the ControlNet on the doubled CFG batch (each branch with its own prompt) and
samples the control image's VAE latents for the two branches apart, from torch's global generator. Here each row
samples them from its own generator seeded with the row's seed (`seed + j`): the unconditional branch's latents
first, then the conditional's, as diffusers' one draw of shape (2, ...) gives them for one image when the global
generator has that seed (the tests seed it so), never touching the process' global generator.
`build_tiny_sd3_controlnet` writes a tiny ControlNet in the real layout for a tiny SD3 checkpoint.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from diffuserve.pipelines import controlnet as rows_of
from diffuserve.pipelines.batch_rows import row_seeds
from diffuserve.pipelines.controlnet import ControlRow


def prepare_control(
    pipe: Any, batch: Sequence[Any], height: int, width: int, timesteps: torch.Tensor, cfg: bool
) -> list[ControlRow | None] | None:
    """Each output row's ControlNet conditioning (None for a plain row); None when no request has a control image."""
    if all(p.control is None for p in batch):
        return None
    processor = VaeImageProcessor(vae_scale_factor=pipe.vae_scale_factor)
    rows: list[ControlRow | None] = []
    for params in batch:
        if params.control is None:
            rows.extend([None] * params.n)
            continue
        net = rows_of.requested_net(params, pipe.recipe.controlnets)
        shift = 0.0 if net.model.config.force_zeros_for_pooled_projection else pipe.vae.config.shift_factor
        image = Image.open(io.BytesIO(params.control.image)).convert("RGB")
        pixels = processor.preprocess(image, height=height, width=width).to(pipe.device, pipe.transformer.dtype)
        with pipe.recipe.component_scope(pipe.decoder):
            dist = pipe.vae.encode(pixels).latent_dist
        c = params.control
        for seed in row_seeds(params):
            shape = (2 if cfg else 1, *dist.mean.shape[1:])
            noise = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), device=pipe.device)
            latents = (dist.mean + dist.std * noise.to(dist.mean.dtype) - shift) * pipe.vae.config.scaling_factor
            rows.append(
                ControlRow(
                    net,
                    latents[-1:],
                    c.mode,
                    c.scale,
                    c.start,
                    c.end,
                    timesteps,
                    params.guidance_scale,
                    uncond=latents[:1] if cfg else None,
                )
            )
    return rows


def controlnet_kwargs(
    pipe: Any,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_embeds: torch.Tensor,
    pooled: torch.Tensor,
    extras: dict[str, Any],
) -> dict[str, Any]:
    """The SD3 DiT's `block_controlnet_hidden_states` for this call ({} when no row has an active ControlNet). With
    CFG the call's rows are [conditional rows; unconditional rows] (the recipe's doubled batch)."""
    rows = rows_of.control_rows(extras)
    if rows is None:
        return {}
    count = len(rows)
    doubled = latents.shape[0] == 2 * count
    groups = rows_of.active_groups(rows, timestep[:count])
    if not groups:
        return {}
    num_blocks = len(pipe.transformer.transformer_blocks)
    total = latents.shape[0]
    acc = None
    for net, index, scales in groups.values():
        picked = [rows[i] for i in index]
        conds = [r.cond for r in picked]
        if doubled:
            index = index + [i + count for i in index]
            scales = scales + scales
            conds = conds + [r.uncond if r.uncond is not None else r.cond for r in picked]
        model = net.model
        pooled_in = torch.zeros_like(pooled[index]) if model.config.force_zeros_for_pooled_projection else pooled[index]
        with pipe.recipe.component_scope(net.key):
            samples = model(
                hidden_states=latents[index],
                timestep=timestep[index],
                encoder_hidden_states=prompt_embeds[index] if model.config.joint_attention_dim is not None else None,
                pooled_projections=pooled_in,
                controlnet_cond=torch.cat(conds),
                conditioning_scale=torch.tensor(scales, device=latents.device, dtype=latents.dtype).view(-1, 1, 1),
                return_dict=False,
            )[0]
        if len(groups) == 1 and index == list(range(total)):
            return {"block_controlnet_hidden_states": samples}
        acc = rows_of.add_blocks(acc, _per_block(rows_of.scatter(samples, index, total), num_blocks))
    return {"block_controlnet_hidden_states": acc}


def _per_block(samples: list[torch.Tensor] | None, num_blocks: int) -> list[torch.Tensor] | None:
    """As the SD3 DiT maps a ControlNet's residuals onto its blocks: block b takes `int(b / (N / len))`."""
    if not samples:
        return None
    interval = num_blocks / len(samples)
    return [samples[int(b / interval)] for b in range(num_blocks)]


def build_tiny_sd3_controlnet(checkpoint: Path, output: Path, *, seed: int = 0, num_layers: int = 1) -> Path:
    """A tiny SD3ControlNetModel for the tiny SD3 checkpoint at `checkpoint` (InstantX's layout: its own patch
    embedding, zero pooled projection), saved with `save_pretrained`; the zero-initialised projections get random
    values so its residuals change the image."""
    import json

    from diffusers import SD3ControlNetModel

    config = json.loads((Path(checkpoint) / "transformer" / "config.json").read_text())
    keys = (
        "sample_size",
        "patch_size",
        "in_channels",
        "attention_head_dim",
        "num_attention_heads",
        "joint_attention_dim",
        "caption_projection_dim",
        "pooled_projection_dim",
        "out_channels",
        "pos_embed_max_size",
        "qk_norm",
    )
    torch.manual_seed(seed)
    model = SD3ControlNetModel(num_layers=num_layers, **{k: config[k] for k in keys if k in config})
    with torch.no_grad():
        for module in [*model.controlnet_blocks, model.pos_embed_input.proj]:
            torch.nn.init.normal_(module.weight, std=0.3)
            torch.nn.init.normal_(module.bias, std=0.05)
    model.eval().save_pretrained(output, safe_serialization=True)
    return Path(output)
