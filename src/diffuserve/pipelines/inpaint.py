"""Inpainting rows, once for every native family whose diffusers pipeline inpaints by latent blending (FLUX.1's
FluxInpaintPipeline, SD3's StableDiffusion3InpaintPipeline, Qwen-Image's QwenImageInpaintPipeline, ...).

Those pipelines share one recipe, which this module follows step for step:
1. the image (and, with `padding_mask_crop`, only a crop around the mask) is preprocessed to the output size and
   its latents re-noised to `strength` (the family's image-to-image start);
2. the mask is preprocessed by a grayscale, binarizing `VaeImageProcessor` and resized to the latent grid (nearest);
3. after every scheduler step the kept region is put back: `latents = (1 - mask) * proper + mask * latents`, where
   `proper` is the clean image latents re-noised to the next timestep (clean after the last step);
4. with `padding_mask_crop` the decoded crop is pasted back over the input image through the mask
   (`apply_overlay`).

Everything here is per row: each output row carries its own mask (a row without a mask carries ones, so the blend
leaves it exactly as the plain image-to-image step made it), image latents, noise and overlay, so requests with
different masks share one batch and each row equals its request run alone.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from diffuserve.pipelines.batch_rows import DenoiseState

EXTRAS_KEY = "inpaint"
"""`DenoiseState.extras` key of a batch's `InpaintRows` (absent when no row of the batch has a mask)."""


def mask_processor(vae_scale_factor: int, latent_channels: int) -> VaeImageProcessor:
    """The mask preprocessor of diffusers' inpaint pipelines (grayscale, [0, 1], binarized at 0.5)."""
    return VaeImageProcessor(
        vae_scale_factor=vae_scale_factor,
        vae_latent_channels=latent_channels,
        do_normalize=False,
        do_binarize=True,
        do_convert_grayscale=True,
    )


@dataclass
class RequestSource:
    """One request's input image and mask, preprocessed to the output size (diffusers' steps 2-4 of `__call__`)."""

    pixels: torch.Tensor
    """(1, 3, H, W) in [-1, 1]: the image, or its crop around the mask."""
    mask: torch.Tensor | None
    """(1, 1, H, W) of 0 / 1 (1 = repaint); None: the request has no mask."""
    overlay: tuple[Image.Image, Image.Image, tuple[int, int, int, int]] | None
    """(mask, input image, crop box) for `apply_overlay` when the request asks for `padding_mask_crop`."""


def request_source(
    params: Any,
    image_processor: VaeImageProcessor,
    masks: VaeImageProcessor,
    height: int,
    width: int,
    resize_first: bool = False,
) -> RequestSource:
    """The request's first input image and its mask, preprocessed as the inpaint pipelines do. `resize_first`:
    the image (and the mask) are resized to the output size before the crop, the overlay's inputs
    (QwenImageEditInpaintPipeline)."""
    source = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB")
    if resize_first:
        source = image_processor.resize(source, height, width)
    if params.mask_input is None:
        pixels = image_processor.preprocess(source, height=height, width=width)
        return RequestSource(pixels=pixels.to(torch.float32), mask=None, overlay=None)
    mask = Image.open(io.BytesIO(params.mask_input)).convert("L")
    if resize_first:
        # Its mask too: diffusers crops and pastes back with the mask as given, which fails (`apply_overlay`) or
        # crops the wrong region unless the mask is at the output size; the resize is the one its preprocess does.
        mask = masks.resize(mask, height, width)
    crop, mode = None, "default"
    if params.padding_mask_crop is not None:
        crop, mode = masks.get_crop_region(mask, width, height, pad=params.padding_mask_crop), "fill"
    pixels = image_processor.preprocess(source, height=height, width=width, crops_coords=crop, resize_mode=mode)
    condition = masks.preprocess(mask, height=height, width=width, resize_mode=mode, crops_coords=crop)
    overlay = (mask, source, crop) if crop is not None else None
    return RequestSource(pixels=pixels.to(torch.float32), mask=condition, overlay=overlay)


@dataclass
class InpaintRows:
    """A batch's inpainting state, one row per output row, in the layout of the denoised latents."""

    mask: torch.Tensor
    """1 = repaint (the denoiser's latents), 0 = keep (the image's); ones for rows without a mask."""
    image_latents: torch.Tensor
    """The clean latents of each row's input image."""
    noise: torch.Tensor
    """The noise each row's start was drawn with (re-used to re-noise the kept region at every step)."""
    overlays: list[tuple[Image.Image, Image.Image, tuple[int, int, int, int]] | None]
    """Per output row: what `apply_overlays` pastes back (padding_mask_crop), or None."""


def latent_mask(mask: torch.Tensor | None, size: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A request's preprocessed mask on the latent grid `size` (h, w) as diffusers' `prepare_mask_latents` makes
    it (nearest resize), or ones for a request without a mask. (1, 1, *size)."""
    if mask is None:
        return torch.ones((1, 1, *size), device=like.device, dtype=like.dtype)
    return torch.nn.functional.interpolate(mask, size=size).to(device=like.device, dtype=like.dtype)


def t_start(strength: float, num_steps: int) -> int:
    """The schedule step at which an edit of `strength` starts: diffusers' `get_timesteps` (`timesteps[t_start:]`)."""
    return int(max(num_steps - min(num_steps * strength, num_steps), 0))


def batch_schedule(batch: Sequence[Any], scheduler: Any, timesteps: torch.Tensor) -> torch.Tensor:
    """The schedule an edit batch runs: the full schedule from the earliest start among its rows (the largest
    `strength`), the scheduler's begin index set there. Rows of smaller strengths join later (`row_starts`)."""
    start = min(t_start(params.strength, len(timesteps)) for params in batch) * scheduler.order
    scheduler.set_begin_index(start)
    return timesteps[start:]


def start_latents(
    scheduler: Any, params: Any, timesteps: torch.Tensor, image_latents: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """A request's rows re-noised to its own start of the full schedule `timesteps`, as its solo run starts.

    diffusers' flow-match `scale_noise` reads the sigma at the scheduler's begin index (not the timestep it is
    given) once one is set, so the begin index is the request's start for the call and the batch's again after."""
    batch_begin = scheduler.begin_index
    start = t_start(params.strength, len(timesteps)) * scheduler.order
    scheduler.set_begin_index(start)
    try:
        return scheduler.scale_noise(image_latents, timesteps[start : start + 1].repeat(params.n), noise)
    finally:
        scheduler.set_begin_index(batch_begin)


def row_starts(batch: Sequence[Any]) -> tuple[int, ...] | None:
    """Per output row of an edit batch: the index of the batch's schedule (`batch_schedule`) at which the row
    starts denoising, the rows of a request of a smaller `strength` later; None when every row starts at once
    (one strength, or no input images).

    Rows that have not started keep their (re-noised) latents untouched: the shared schedule's sigmas are the
    solo run's from the row's start on, so each row equals its request run alone."""
    if not batch or not batch[0].image_inputs:
        return None
    starts = [t_start(params.strength, params.num_inference_steps) for params in batch]
    first = min(starts)
    if all(start == first for start in starts):
        return None
    return tuple(start - first for params, start in zip(batch, starts, strict=True) for _ in range(params.n))


def keep_waiting(
    stepped: torch.Tensor, latents: torch.Tensor, starts: tuple[int, ...] | None, step_index: int
) -> torch.Tensor:
    """After the scheduler step `step_index`: the stepped latents of the rows that have started (`row_starts`),
    the unchanged latents of the rows still waiting for their start. The shared scheduler's step index is theirs
    too (every started row is at the batch's step), so no row needs a scheduler of its own."""
    if starts is None or max(starts) <= step_index:
        return stepped
    started = torch.tensor([start <= step_index for start in starts], device=latents.device)
    return torch.where(started.view(-1, *([1] * (latents.dim() - 1))), stepped, latents)


def started_prediction(
    pipeline: Any, starts: tuple[int, ...] | None, latents: torch.Tensor, timestep: torch.Tensor, *call: Any
) -> torch.Tensor:
    """`pipeline.guided_prediction` at step `call[3]` for the rows that have started (`row_starts`) only: rows
    still waiting cost nothing. Their conditioning is gathered, the extras cut (`narrow_state`) and per-row layers
    (LoRA) follow the narrowed call (`runtime/row_context.py`), as a step cache narrows its blocks; the waiting
    rows' prediction is zero (`keep_waiting` leaves their latents untouched whatever it is). Row caches never
    come here: a step cache keeps one strength per batch (`sampling.row_fields`)."""
    positive, negative, head, state, step_index, model_key, rows = call
    if starts is None or max(starts) <= step_index:
        return pipeline.guided_prediction(latents, timestep, *call)
    from diffuserve.pipelines.batch_rows import gather_rows
    from diffuserve.runtime.row_context import narrowed

    started = tuple(r for r, start in enumerate(starts) if start <= step_index)
    index = torch.tensor(started, device=latents.device)
    masked = pipeline.adapter.masked_sequences
    narrow = (gather_rows(c, index, masked) if c is not None else None for c in (positive, negative))
    with narrowed(started, latents.shape[0]):
        pred = pipeline.guided_prediction(
            latents[index], timestep[index], *narrow, head, pipeline.narrow_state(state, index), step_index, model_key
        )
    out = pred.new_zeros((latents.shape[0], *pred.shape[1:]))
    out[index] = pred
    return out


def any_mask(batch: Sequence[Any]) -> bool:
    return any(params.mask_input is not None for params in batch)


def blended_step(
    noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
) -> torch.Tensor:
    """A masked edit family's `scheduler_step`: the scheduler's step, then (inpainting rows) the kept region put back
    (`blend`; a no-op for other batches)."""
    return blend(state.scheduler.step(noise_pred, timestep, latents, return_dict=False)[0], state)


def blend(latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
    """After a scheduler step: put the kept region back, re-noised to the next timestep (clean after the last).

    The scheduler's step index has just moved to the next sigma, which is the one diffusers re-noises with
    (`scale_noise` at `timesteps[i + 1]`); after the last step the image latents go back clean."""
    rows: InpaintRows | None = state.extras.get(EXTRAS_KEY)
    if rows is None:
        return latents
    scheduler = state.scheduler
    proper = rows.image_latents
    begin = scheduler.begin_index or 0
    if scheduler.step_index - begin < len(state.timesteps):
        next_t = state.timesteps[scheduler.step_index - begin]
        proper = scheduler.scale_noise(proper, torch.tensor([next_t]), rows.noise)
    return (1 - rows.mask) * proper + rows.mask * latents


def apply_overlays(images: list[Image.Image], state: DenoiseState, processor: VaeImageProcessor) -> list[Image.Image]:
    """`padding_mask_crop` rows: the decoded crop pasted back over the input image (diffusers' `apply_overlay`)."""
    rows: InpaintRows | None = state.extras.get(EXTRAS_KEY)
    if rows is None or not any(rows.overlays):
        return images
    return [
        image if overlay is None else processor.apply_overlay(overlay[0], overlay[1], image, overlay[2])
        for image, overlay in zip(images, rows.overlays, strict=True)
    ]
