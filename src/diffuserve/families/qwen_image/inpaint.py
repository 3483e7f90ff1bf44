"""Qwen-Image inpainting's start (`QwenImageInpaintPipeline`), per request, for the native adapter
(`families/qwen_image/adapter.py`; the per-row blend and paste-back are `pipelines/inpaint.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from diffuserve.families.qwen_image import ops
from diffuserve.pipelines import inpaint, recipe


def prepare_inpaint_latents(
    pipe: Any,
    batch: Sequence[Any],
    scheduler: Any,
    timesteps: torch.Tensor,
    channels: int,
    resize_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, inpaint.InpaintRows]:
    """QwenImageInpaintPipeline's start (and QwenImageEditInpaintPipeline's, which resizes the image to the output
    size first: `resize_first`), per request: the image encoded once by the video VAE (row 0's
    generator), normalised by the VAE's latents mean / std, re-noised to `strength` with one noise row per output
    ((1, C, h, w) each, the frame axis first as diffusers draws it); every row's mask, image latents and noise
    packed for the blend after each step."""
    from diffusers import QwenImagePipeline

    head = batch[0]
    full, timesteps = timesteps, inpaint.batch_schedule(batch, scheduler, timesteps)
    lh, lw = pipe._latent_hw(head.height, head.width)
    rows, clean, noises, masks, overlays = [], [], [], [], []
    for params in batch:
        generators = [torch.Generator("cpu").manual_seed(s) for s in recipe.row_seeds(params)]
        source = inpaint.request_source(
            params, pipe.image_processor, pipe.mask_processor, head.height, head.width, resize_first
        )
        pixels = source.pixels.unsqueeze(2).to(pipe.device, pipe.dtype)
        encoded = retrieve_latents(pipe.vae.encode(pixels), generator=generators[0])
        mean, std = ops.latents_stats(pipe.vae, encoded)
        image_latents = ((encoded - mean) * (1.0 / std)).expand(params.n, -1, -1, -1, -1).transpose(1, 2)
        noise = randn_tensor(
            (params.n, 1, channels, lh, lw), generator=generators, device=pipe.device, dtype=pipe.dtype
        )
        rows.append(inpaint.start_latents(scheduler, params, full, image_latents, noise))
        clean.append(image_latents)
        noises.append(noise)
        mask = inpaint.latent_mask(source.mask, (lh, lw), noise)
        masks.append(mask.expand(params.n, channels, -1, -1))
        overlays += [source.overlay] * params.n

    def pack(x: torch.Tensor) -> torch.Tensor:
        return QwenImagePipeline._pack_latents(x, x.shape[0], channels, lh, lw)

    latents, clean_rows, noise_rows = (pack(torch.cat(part)) for part in (rows, clean, noises))
    return latents, timesteps, inpaint.InpaintRows(pack(torch.cat(masks)), clean_rows, noise_rows, overlays)


def narrow_state(pipe: Any, state: Any, index: torch.Tensor) -> Any:
    """`RecipePipeline.narrow_state` for Qwen-Image: rows `index` of the image shapes (one entry per output row)."""
    shapes = [state.extras["img_shapes"][r] for r in index.tolist()]
    return dataclasses.replace(state, extras={**state.extras, "img_shapes": shapes})
