"""FLUX.2 Klein inpainting: diffusers' `Flux2KleinInpaintPipeline` on the shared recipe (`pipelines/inpaint.py`).

What Klein's inpaint pipeline does beyond the shared recipe, and we therefore do:
- the input image's clean latents (VAE distribution mode, patchified, batch-norm normalised) are both the start the
  rows are re-noised from (to `strength`) and a condition: their packed tokens follow the noise tokens in every
  transformer call as reference image 0 (time id 10); further input images follow as references 1, 2, ... (the
  pipeline's `image_reference`, time ids 20, ...);
- the mask is resized to the token grid bilinearly (not nearest, as FLUX.1's) and packed to one channel per token;
- the blend after each step, and the `padding_mask_crop` paste-back, are the shared recipe's.

Each row carries its own image, condition tokens, mask and noise, so requests with different masks (same size and
reference layout: one signature) share a call and each row equals its request run alone. A request without a mask is
a reference edit (pure noise, the whole schedule), a different program: it never shares a call with masked rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline, retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from diffuserve.pipelines import inpaint, recipe
from diffuserve.pipelines.recipe import Cond, DenoiseState


def mask_processor(size_multiple: int, latent_channels: int) -> Flux2ImageProcessor:
    """Klein's inpaint mask preprocessor (grayscale, [0, 1], binarized at 0.5), as the diffusers pipeline builds it."""
    return Flux2ImageProcessor(
        vae_scale_factor=size_multiple,
        vae_latent_channels=latent_channels,
        do_normalize=False,
        do_binarize=True,
        do_convert_rgb=False,
        do_convert_grayscale=True,
    )


def encode_image(pipe: Any, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_encode_vae_image`: distribution mode (no noise), patchified, batch-norm normalised. (1, 4C, h, w)."""
    latent = retrieve_latents(pipe.vae.encode(pixels.to(pipe.device, pipe.vae.dtype)), sample_mode="argmax")
    latent = Flux2Pipeline._patchify_latents(latent)
    mean, std = pipe._bn_stats(latent)
    return ((latent - mean) / std).to(dtype)


def _plain_rows_refused(batch: Sequence[Any]) -> None:
    plain = [params for params in batch if params.mask_input is None]
    if plain:
        raise ValueError(
            "flux2_klein: a reference edit (no mask) cannot share a pipeline call with masked rows: it starts from "
            "pure noise over the whole schedule; run it in its own call (the server never merges edits)."
        )


def prepare_masked(pipe: Any, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
    """Klein inpaint's start per request: its image (or crop) at the output size, encoded; one noise row per output
    (row j from seed + j) re-noising it to `strength`; its condition tokens (image, then references) and mask."""
    _plain_rows_refused(batch)
    tokens_h, tokens_w = head.height // pipe.size_multiple, head.width // pipe.size_multiple
    scheduler, timesteps = pipe._schedule(head.num_inference_steps, tokens_h * tokens_w, head.flow_shift)
    num_steps = len(timesteps)
    t_start = int(max(num_steps - min(num_steps * head.strength, num_steps), 0))
    timesteps = timesteps[t_start * scheduler.order :]
    scheduler.set_begin_index(t_start * scheduler.order)
    dtype = positive["prompt_embeds"].dtype
    masks = mask_processor(pipe.size_multiple, pipe.vae.config.latent_channels)
    rows, clean, noises, mask_rows, conditions, overlays, ids = [], [], [], [], [], [], None
    for params in batch:
        generators = [torch.Generator("cpu").manual_seed(s) for s in recipe.row_seeds(params)]
        source = inpaint.request_source(params, pipe.image_processor, masks, head.height, head.width)
        image_latents = encode_image(pipe, source.pixels, dtype)
        latents = [image_latents, *pipe._reference_latents(params.image_inputs[1:])]
        request_ids = Flux2Pipeline._prepare_image_ids(latents)[0].to(pipe.device)
        if ids is not None and not torch.equal(ids, request_ids):
            raise ValueError("flux2_klein: merged masked rows must carry references of the same sizes.")
        ids = request_ids
        tokens = torch.cat([Flux2Pipeline._pack_latents(x)[0] for x in latents]).unsqueeze(0)
        conditions.append(tokens.expand(params.n, -1, -1))
        image_latents = image_latents.expand(params.n, -1, -1, -1)
        noise = randn_tensor(image_latents.shape, generator=generators, device=pipe.device, dtype=dtype)
        rows.append(scheduler.scale_noise(image_latents, timesteps[:1].repeat(params.n), noise))
        clean.append(image_latents)
        noises.append(noise)
        # prepare_mask_latents: bilinear to the token grid, packed to (rows, tokens, 1).
        mask = torch.nn.functional.interpolate(source.mask, size=(tokens_h, tokens_w), mode="bilinear")
        mask_rows.append(mask.to(pipe.device, dtype).expand(params.n, -1, -1, -1))
        overlays += [source.overlay] * params.n
    pack = Flux2Pipeline._pack_latents
    state = inpaint.InpaintRows(pack(torch.cat(mask_rows)), pack(torch.cat(clean)), pack(torch.cat(noises)), overlays)
    extras = {
        "tokens": (tokens_h, tokens_w),
        "img_ids": torch.cat([pipe._latent_ids_for(tokens_h, tokens_w), ids]),
        "txt_ids": pipe._text_ids_for(positive["prompt_embeds"].shape[1]),
        "guidance": pipe._guidance_vector(head),
        "reference": torch.cat(conditions),
        inpaint.EXTRAS_KEY: state,
    }
    return DenoiseState(latents=pack(torch.cat(rows)), timesteps=timesteps, scheduler=scheduler, extras=extras)
