"""Native Z-Image / Z-Image-Turbo: diffusers' model classes and scheduler on the shared recipe.

The family parts follow `diffusers.ZImagePipeline` step for step, so the same request and the same call
give the same image:
- every text (prompt or negative prompt) is wrapped in the tokenizer's chat template as one user turn
  (`add_generation_prompt=True, enable_thinking=True`), padded to `max_sequence_length` (512) and encoded;
  the embedding is the second-to-last hidden state at the real (unmasked) tokens, so each row has its own
  length: the recipe pads rows to a common width with a mask (`masked_sequences`) and `predict` hands the
  transformer the per-row lists it takes;
- CFG runs when `guidance_scale > 0` (not > 1) as `pos + g * (pos - neg)`, in one transformer call on
  [positives..., negatives...] like diffusers; the empty string is the negative prompt when none is given;
  `cfg_normalization` and `cfg_truncation` keep diffusers' defaults (off / 1.0, i.e. no effect);
- the transformer sees `(1000 - t) / 1000` and predicts the negative velocity, so the scheduler steps on
  `-prediction`; sigmas are `linspace(1, 1/steps, steps)` with the scheduler's own shift.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.pipelines.z_image.pipeline_z_image import (
    get_default_z_image_sigmas,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from diffuserve.pipelines import inpaint, packing, recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.prompt_limits import TextReading
from diffuserve.pipelines.recipe import Cond, DenoiseState
from diffuserve.pipelines.schedules import flow_schedule

logger = logging.getLogger(__name__)

MAX_SEQUENCE_LENGTH = 512
"""Tokens per text: ZImagePipeline's `max_sequence_length` default (texts are padded to it before encoding,
as diffusers does, so the embeddings are bit-identical to its call)."""


def _chat(tokenizer: Any, text: str) -> str:
    """A text as one user turn of the chat template, as diffusers' ZImagePipeline gives it to Qwen3."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )


class ZImageAdapter(AdapterBase):
    """Z-Image and Z-Image-Turbo text-to-image, the adapter of the recipe."""

    family = "z_image"
    masked_sequences = {"prompt_embeds": "prompt_mask"}

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        tokenizer: Any,
        scheduler: Any,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.bind_parts(
            {
                "text_encoder": text_encoder,
                "tokenizer": tokenizer,
                "transformer": transformer,
                "vae": vae,
                "scheduler": scheduler,
            },
            device=device,
            dtype=dtype,
        )
        # Size multiple (VAE factor x 2), the RoPE tables' size limits (axes 1 and 2), default size and CFG as one
        # doubled batch: the spec's facts.
        self.vae_scale_factor = self.bind_facts(component_configs(self.components)).vae_factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.mask_processor = inpaint.mask_processor(self.vae_scale_factor * 2, self.vae.config.latent_channels)
        axes_lens = list(transformer.config.axes_lens)
        # The caption occupies indices 1..len (padded to 32) of RoPE axis 0, so axis 0 bounds the text length.
        self.max_sequence_length = min(MAX_SEQUENCE_LENGTH, (axes_lens[0] - 2) // 32 * 32)
        if self.max_sequence_length < MAX_SEQUENCE_LENGTH:
            logger.warning(
                "z_image: axes_lens[0]=%d limits texts to %d tokens (diffusers' default is %d)",
                axes_lens[0],
                self.max_sequence_length,
                MAX_SEQUENCE_LENGTH,
            )
        self._schedules: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}
        # The prompt counter's reading: the caption axis bounds the text; each text is one user turn of the chat
        # template (`encode_text`).
        framed = TextReading(self.max_sequence_length, lambda tokenizer: len(tokenizer(_chat(tokenizer, "")).input_ids))
        self.text_readings = {"tokenizer": framed}

    # -- family parts ------------------------------------------------------------------------------------

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: Any, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        # Z-Image's form (not uncond + g * (cond - uncond)): g = 0 means no guidance, and the operand
        # order is diffusers' so the floats match.
        return cond + head.guidance_scale * (cond - uncond)

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """Chat-templated texts through Qwen3; `prompt_embeds` (second-to-last hidden state) + `prompt_mask`."""
        templated = [_chat(self.tokenizer, text) for text in texts]
        inputs = self.tokenizer(
            templated, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt"
        )
        ids = inputs.input_ids.to(self.device)
        mask = inputs.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": hidden, "prompt_mask": mask}

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return 2 * (height // self.size_multiple), 2 * (width // self.size_multiple)

    def _schedule(
        self, num_steps: int, image_seq_len: int, flow_shift: float | None = None
    ) -> tuple[Any, torch.Tensor]:
        """A private scheduler with this shape's timesteps (the set-up is cached per shape and `flow_shift`)."""

        return flow_schedule(
            self._schedules,
            self.scheduler,
            retrieve_timesteps,
            self.device,
            num_steps,
            flow_shift,
            shape_key=(image_seq_len,),
            sigmas=lambda config: get_default_z_image_sigmas(num_steps),
            mu=lambda config: recipe.dynamic_shift_mu(config, image_seq_len),
        )

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        """float32 noise rows (diffusers keeps Z-Image latents in float32), the schedule for this size."""
        lh, lw = self._latent_hw(head.height, head.width)
        channels = self.transformer.config.in_channels
        scheduler, timesteps = self._schedule(head.num_inference_steps, (lh // 2) * (lw // 2), head.flow_shift)
        if head.image_inputs:
            latents, timesteps, masked = self.prepare_inpaint_latents(batch, scheduler, timesteps, positive)
            return DenoiseState(latents, timesteps, scheduler, extras={inpaint.EXTRAS_KEY: masked})
        latents = recipe.batch_noise(batch, (channels, lh, lw), device=self.device, dtype=torch.float32)
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras={})

    # -- inpainting (ZImageInpaintPipeline; pipelines/inpaint.py) ----------------------------------------------

    def prepare_inpaint_latents(
        self, batch: Sequence[Any], scheduler: Any, timesteps: torch.Tensor, positive: Cond
    ) -> tuple[torch.Tensor, torch.Tensor, inpaint.InpaintRows]:
        """ZImageInpaintPipeline's start per request: the image encoded once (row 0's generator), re-noised to
        `strength` with one noise row per output, in the text embeddings' dtype; the rows' masks for the blend."""
        head = batch[0]
        full, timesteps = timesteps, inpaint.batch_schedule(batch, scheduler, timesteps)
        dtype = positive["prompt_embeds"].dtype
        rows, clean, noises, masks = [], [], [], []
        for params in batch:
            generators = [torch.Generator("cpu").manual_seed(s) for s in recipe.row_seeds(params)]
            source = inpaint.request_source(params, self.image_processor, self.mask_processor, head.height, head.width)
            encoded = retrieve_latents(self.vae.encode(source.pixels.to(self.device, dtype)), generator=generators[0])
            image_latents = (encoded - self.vae.config.shift_factor) * self.vae.config.scaling_factor
            image_latents = image_latents.expand(params.n, -1, -1, -1)
            noise = randn_tensor(image_latents.shape, generator=generators, device=self.device, dtype=dtype)
            rows.append(inpaint.start_latents(scheduler, params, full, image_latents, noise))
            clean.append(image_latents)
            noises.append(noise)
            mask = inpaint.latent_mask(source.mask, tuple(noise.shape[2:]), noise)
            masks.append(mask.expand(params.n, -1, -1, -1))
        overlays: list[Any] = [None] * sum(p.n for p in batch)
        rows_state = inpaint.InpaintRows(torch.cat(masks), torch.cat(clean), torch.cat(noises), overlays)
        return torch.cat(rows), timesteps, rows_state

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        if "packed" in state.extras:
            return self.predict_packed(latents, timestep, cond, state)
        frames = latents.to(self.transformer.dtype).unsqueeze(2)  # one frame per image: (C, 1, h, w) items
        captions = [embeds[mask] for embeds, mask in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        out = self.transformer(list(frames.unbind(dim=0)), (1000 - timestep) / 1000, captions, return_dict=False)[0]
        return torch.stack([o.float() for o in out], dim=0).squeeze(2)

    # -- packed mixed-size calls (pipelines/packing.py) -------------------------------------------------------

    def packed_layout(self, groups: list[packing.SizeGroup], positive: Cond) -> packing.PackedRows:
        """Caption tokens (the mask's) and 2x2 patches per row (the transformer pads and masks them itself)."""
        text = [int(n) for n in positive["prompt_mask"].sum(dim=1).tolist()]
        rows = [g for g in groups for _ in range(g.rows.stop - g.rows.start)]
        patches = [(g.spatial[1] // 2) * (g.spatial[2] // 2) for g in rows if g.spatial is not None]
        return packing.PackedRows(tuple(text), tuple(patches), max(text), max(patches))

    def predict_packed(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState
    ) -> torch.Tensor:
        """Z-Image's transformer takes a list of images of any size and captions of any length, and itself pads
        each to the call's longest, masks the padding and gives each its own RoPE positions: the packed rows are
        handed over as that list, each at its own size, and its outputs padded back to the call's tokens."""
        packed: packing.Packed = state.extras["packed"]
        owner = [g for g in packed.groups for _ in range(g.rows.stop - g.rows.start)]
        owner = owner * (latents.shape[0] // len(owner))  # both halves of a doubled CFG batch
        items = [
            g.latents_of(latents[i : i + 1])[0].to(self.transformer.dtype).unsqueeze(1) for i, g in enumerate(owner)
        ]
        captions = [embeds[mask] for embeds, mask in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        out = self.transformer(items, (1000 - timestep) / 1000, captions, return_dict=False)[0]
        tokens = [o.float().squeeze(1).flatten(1).transpose(0, 1)[None] for o in out]
        return packing.pad_tokens(tokens, latents.shape[1])

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        # The transformer predicts the negative of the scheduler's velocity; inpainting rows then keep their region.
        latents = state.scheduler.step((-noise_pred).to(torch.float32), timestep, latents, return_dict=False)[0]
        return inpaint.blend(latents, state)

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        return recipe.to_pil_images(image)
