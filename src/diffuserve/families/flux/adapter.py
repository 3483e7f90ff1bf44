"""Native FLUX.1 adapter: diffusers' model classes and scheduler, driven by the shared recipe (`RecipePipeline`).

The family parts follow `diffusers.FluxPipeline` step for step (so outputs match it) for a batch of
requests: per-row prompts, per-request seeds and `n`, one shared signature (size, steps, guidance).
What is constant per shape (image position ids, text ids, the scheduler's timesteps) is cached, and
there is no progress bar or input re-tokenisation, which is where the speed over diffusers comes from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, retrieve_timesteps
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from diffuserve.families.flux import controlnet as flux_controlnet
from diffuserve.families.flux.ops import FluxPacking
from diffuserve.family_spec.checkpoint import required_components
from diffuserve.pipelines import inpaint, recipe, token_ids
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs, declared_sequence_length
from diffuserve.pipelines.controlnet import EXTRAS_KEY, merge_rows
from diffuserve.pipelines.recipe import Cond, DenoiseState
from diffuserve.pipelines.schedules import flow_schedule

logger = logging.getLogger(__name__)

MAX_CACHED_SHAPES = 64
"""Per-shape caches (position ids, timesteps) are cleared past this many entries, so a stream of
requests with ever new sizes or step counts cannot grow memory without bound."""


def _make_room(cache: dict) -> None:
    if len(cache) >= MAX_CACHED_SHAPES:
        cache.clear()


class FluxAdapter(FluxPacking, AdapterBase):
    """FLUX.1 text-to-image (dev and schnell style), the adapter of the recipe. Its static facts (size multiple,
    dev/schnell defaults, continuous, text encoders) are the family spec's (`family_spec/flux.py`, `bind_facts`)."""

    family = "flux"
    supports_controlnet = True
    """`--controlnet` FluxControlNetModel (incl. Union) rows run natively (`families/flux/controlnet.py`)."""

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        tokenizer: Any,
        text_encoder_2: Any,
        tokenizer_2: Any,
        scheduler: Any,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int = 512,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length
        """T5 tokens per prompt: diffusers' 512, capped by what tokenizer_2 declares (see from_components)."""
        self.components = {
            "text_encoder": text_encoder,
            "text_encoder_2": text_encoder_2,
            "transformer": transformer,
            "vae": vae,
        }
        self.vae_scale_factor = self.bind_facts(component_configs(self.components)).vae_factor
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=self.vae_scale_factor * 2, vae_latent_channels=vae.config.latent_channels
        )
        self.mask_processor = inpaint.mask_processor(self.vae_scale_factor * 2, vae.config.latent_channels)
        self._clip_max_length = getattr(tokenizer, "model_max_length", 77) or 77
        self._image_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._text_ids: dict[int, torch.Tensor] = {}
        self._schedulers: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> FluxAdapter:
        """Build from the loader's model_index.json key -> loaded object mapping."""
        return cls(
            **required_components(cls.family, components),
            device=device,
            dtype=dtype,
            max_sequence_length=declared_sequence_length(components["tokenizer_2"], 512),
        )

    # -- 1. encode prompts ----------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """CLIP's pooled output (`pooled`) or T5's hidden states (`prompt_embeds`), one row per text."""
        # The ids the server's prompt count made travel with the requests (tokenize once, pipelines/token_ids.py).
        if key == "text_encoder":
            ids = token_ids.padded_ids(self.tokenizer, "tokenizer", texts, batch, self._clip_max_length)
            if ids is None:
                ids = self.tokenizer(
                    texts, padding="max_length", max_length=self._clip_max_length, truncation=True, return_tensors="pt"
                ).input_ids
            out = self.text_encoder(ids.to(self.device), output_hidden_states=False)
            return {"pooled": out.pooler_output.to(self.dtype)}
        ids = token_ids.padded_ids(self.tokenizer_2, "tokenizer_2", texts, batch, self.max_sequence_length)
        if ids is None:
            ids = self.tokenizer_2(
                texts, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt"
            ).input_ids
        out = self.text_encoder_2(ids.to(self.device), output_hidden_states=False)[0]
        return {"prompt_embeds": out.to(self.dtype)}

    # -- 2. latents -------------------------------------------------------------------------------------

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return 2 * (height // (self.vae_scale_factor * 2)), 2 * (width // (self.vae_scale_factor * 2))

    def prepare_latents(self, batch: Sequence[Any], height: int, width: int) -> torch.Tensor:
        """Packed initial noise, one row per output, each drawn from its request's row generator."""
        lh, lw = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        noise = recipe.batch_noise(batch, (channels, lh, lw), device=self.device, dtype=self.dtype)
        return FluxPipeline._pack_latents(noise, noise.shape[0], channels, lh, lw)

    def prepare_image_latents(
        self, batch: Sequence[Any], height: int, width: int, scheduler: Any, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, inpaint.InpaintRows | None]:
        """Image-to-image start: each request's input image, VAE-encoded and re-noised to `strength`.

        Follows diffusers' FluxImg2ImgPipeline (and FluxInpaintPipeline, whose start is the same): the schedule starts
        at step `steps - steps*strength`; a request's row generators sample its image latents (row 0's generator) and
        then draw one noise row each, so a request's rows are the same alone or in a batch. When a request of the
        batch has a mask, also the rows' inpainting state (`inpaint_rows`)."""
        full, timesteps = timesteps, inpaint.batch_schedule(batch, scheduler, timesteps)
        lh, lw = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        rows, clean, noises, sources = [], [], [], []
        for params in batch:
            generators = [torch.Generator("cpu").manual_seed(s) for s in recipe.row_seeds(params)]
            source = self.edit_source(params, height, width)
            encoded = self.vae.encode(source.pixels.to(self.device, self.vae.dtype))
            image_latents = retrieve_latents(encoded, generator=generators[0])
            image_latents = (image_latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor
            noise = randn_tensor(
                (params.n, channels, lh, lw), generator=generators, device=self.device, dtype=self.dtype
            )
            image_latents = image_latents.to(self.dtype).expand(params.n, -1, -1, -1)
            rows.append(inpaint.start_latents(scheduler, params, full, image_latents, noise))
            clean.append(image_latents)
            noises.append(noise)
            sources.append(source)
        latents = torch.cat(rows)
        packed = FluxPipeline._pack_latents(latents, latents.shape[0], channels, lh, lw)
        state = (
            self.inpaint_rows(batch, sources, torch.cat(clean), torch.cat(noises)) if inpaint.any_mask(batch) else None
        )
        return packed, timesteps, state

    # -- inpainting (FluxInpaintPipeline; pipelines/inpaint.py) ------------------------------------------------

    def edit_source(self, params: Any, height: int, width: int) -> inpaint.RequestSource:
        """A request's input image (its crop, with padding_mask_crop) and mask, preprocessed to the output size."""
        return inpaint.request_source(params, self.image_processor, self.mask_processor, height, width)

    def inpaint_rows(
        self,
        batch: Sequence[Any],
        sources: Sequence[inpaint.RequestSource],
        image_latents: torch.Tensor,
        noise: torch.Tensor,
    ) -> inpaint.InpaintRows:
        """The rows' masks on the packed latent grid (ones for rows without a mask), clean image latents and noise,
        packed as FluxInpaintPipeline's `prepare_mask_latents` / `prepare_latents` pack them."""
        channels, lh, lw = image_latents.shape[1:]
        masks = [
            inpaint.latent_mask(source.mask, (lh, lw), image_latents).expand(params.n, channels, -1, -1)
            for params, source in zip(batch, sources, strict=True)
        ]
        mask = torch.cat(masks)

        def pack(x: torch.Tensor) -> torch.Tensor:
            return FluxPipeline._pack_latents(x, x.shape[0], channels, lh, lw)

        overlays = [source.overlay for params, source in zip(batch, sources, strict=True) for _ in range(params.n)]
        return inpaint.InpaintRows(pack(mask), pack(image_latents), pack(noise), overlays)

    def _image_ids_for(self, height: int, width: int) -> torch.Tensor:
        key = (height, width)
        if key not in self._image_ids:
            _make_room(self._image_ids)
            lh, lw = self._latent_hw(height, width)
            self._image_ids[key] = FluxPipeline._prepare_latent_image_ids(1, lh // 2, lw // 2, self.device, self.dtype)
        return self._image_ids[key]

    def _text_ids_for(self, seq_len: int) -> torch.Tensor:
        if seq_len not in self._text_ids:
            _make_room(self._text_ids)
            self._text_ids[seq_len] = torch.zeros(seq_len, 3, device=self.device, dtype=self.dtype)
        return self._text_ids[seq_len]

    def _timesteps(
        self, num_steps: int, image_seq_len: int, flow_shift: float | None = None
    ) -> tuple[Any, torch.Tensor]:
        """A private scheduler with its timesteps set for this shape and shift (the set-up is cached per key)."""

        return flow_schedule(
            self._schedulers,
            self.scheduler,
            retrieve_timesteps,
            self.device,
            num_steps,
            flow_shift,
            shape_key=(image_seq_len,),
            sigmas=lambda config: (
                None if getattr(config, "use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
            ),
            mu=lambda config: recipe.dynamic_shift_mu(config, image_seq_len),
        )

    # -- 4. decode --------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """Unpack, unscale and VAE-decode; returns PIL images (the same rounding as diffusers)."""
        height, width = state.extras["size"]
        latents = FluxPipeline._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return inpaint.apply_overlays(recipe.to_pil_images(image), state, self.image_processor)

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        # Keep the step's velocity for `preview` (a reference, no copy; the final latents are unchanged).
        state.extras["velocity"] = noise_pred
        return inpaint.blended_step(noise_pred, timestep, latents, state)

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """Partial image: a VAE decode of the clean-latent estimate, not of the noisy latents.

        Flow matching steps x <- x + (sigma_next - sigma) * v, so right after a step the estimate of the
        clean latents is x0 = x - sigma_next * v (exact for the straight path the model predicts).
        """
        velocity = state.extras.get("velocity")
        scheduler = state.scheduler
        if velocity is not None and getattr(scheduler, "step_index", None) is not None:
            sigma = scheduler.sigmas[scheduler.step_index].to(latents.device, latents.dtype)
            latents = latents - sigma * velocity.to(latents.dtype)
        return self.decode(latents, state)

    # -- 2./3. the batch's schedule and the transformer call ------------------------------------------------

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        """Per-request seeds, then the cached position ids and timesteps. Image-conditioned requests (edits)
        start from their re-noised input image instead."""
        height, width = head.height, head.width
        lh, lw = self._latent_hw(height, width)
        scheduler, timesteps = self._timesteps(head.num_inference_steps, (lh // 2) * (lw // 2), head.flow_shift)
        control = masked = None
        if head.image_inputs:
            latents, timesteps, masked = self.prepare_image_latents(batch, height, width, scheduler, timesteps)
        elif any(p.control is not None for p in batch):
            latents, control = flux_controlnet.prepare_control_latents(self, batch, height, width, positive, timesteps)
        else:
            latents = self.prepare_latents(batch, height, width)
        guidance_vec = None
        if self.transformer.config.guidance_embeds:
            guidance_vec = torch.full([1], head.guidance_scale, device=self.device, dtype=torch.float32)
        extras = {
            "size": (height, width),
            "img_ids": self._image_ids_for(height, width),
            "txt_ids": self._text_ids_for(positive["prompt_embeds"].shape[1]),
            "guidance": guidance_vec,
        }
        if control is not None:
            extras[EXTRAS_KEY] = control
        if masked is not None:
            extras[inpaint.EXTRAS_KEY] = masked
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        if "packed" in state.extras:
            return self.predict_packed(latents, timestep, cond, state)
        guidance = state.extras["guidance"]
        control = flux_controlnet.controlnet_kwargs(self, latents, timestep, state.extras)
        return self.transformer(
            hidden_states=latents,
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None if guidance is None else guidance.expand(latents.shape[0]),
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=state.extras["txt_ids"],
            img_ids=state.extras["img_ids"],
            return_dict=False,
            **control,
        )[0]

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        """The first state's extras (size and guidance are the group key's), with every state's ControlNet rows."""
        control = merge_rows([s.extras for s in states], [s.latents.shape[0] for s in states])
        if control is None:
            return states[0].extras
        return {**{k: v for k, v in states[0].extras.items() if not k.startswith("_")}, EXTRAS_KEY: control}


class FluxFillAdapter(FluxAdapter):
    """FLUX.1 Fill (`FluxFillPipeline`): the FLUX.1 recipe with a transformer whose input is widened by the masked
    image's packed latents and the packed 8x8 mask, concatenated to every row's latents at every step (no latent blend).

    Each row carries its own conditioning (image, mask), so requests with different masks share one call. A request
    without a mask repaints the whole image (an all-white mask, a call diffusers runs the same way)."""

    family = "flux_fill"
    min_image_inputs = 1
    """Fill repaints an input image: every request carries one (the warm-up sends one, without a mask)."""

    def prepare_image_latents(
        self, batch: Sequence[Any], height: int, width: int, scheduler: Any, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, inpaint.InpaintRows | None]:
        """FluxFillPipeline's start per request: image latents (row 0's generator) re-noised to `strength` with one
        noise row per output, then the masked image (`image * (1 - mask)`) encoded with row 0's generator again, and
        the mask folded into the VAE factor's f x f channels; both packed into the rows' conditioning."""
        full, timesteps = timesteps, inpaint.batch_schedule(batch, scheduler, timesteps)
        lh, lw = self._latent_hw(height, width)
        channels, f = self.vae.config.latent_channels, self.vae_scale_factor
        rows, conditions = [], []
        for params in batch:
            generators = [torch.Generator("cpu").manual_seed(s) for s in recipe.row_seeds(params)]
            source = self.edit_source(params, height, width)
            mask = source.mask if source.mask is not None else torch.ones_like(source.pixels[:, :1])
            image_latents = self._encode(source.pixels, generators[0]).expand(params.n, -1, -1, -1)
            noise = randn_tensor(
                (params.n, channels, lh, lw), generator=generators, device=self.device, dtype=self.dtype
            )
            rows.append(inpaint.start_latents(scheduler, params, full, image_latents, noise))
            masked = self._encode((source.pixels * (1 - mask)).to(self.dtype), generators[0]).repeat(params.n, 1, 1, 1)
            folded = mask[:, 0].view(1, lh, f, lw, f).permute(0, 2, 4, 1, 3).reshape(1, f * f, lh, lw)
            folded = folded.to(self.device, self.dtype).repeat(params.n, 1, 1, 1)
            packed = (FluxPipeline._pack_latents(x, params.n, x.shape[1], lh, lw) for x in (masked, folded))
            conditions.append(torch.cat(tuple(packed), dim=-1))
        latents = torch.cat(rows)
        self._fill_condition = torch.cat(conditions)
        return FluxPipeline._pack_latents(latents, latents.shape[0], channels, lh, lw), timesteps, None

    def _encode(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        encoded = retrieve_latents(self.vae.encode(pixels.to(self.device, self.vae.dtype)), generator=generator)
        return ((encoded - self.vae.config.shift_factor) * self.vae.config.scaling_factor).to(self.dtype)

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        state = super().prepare(batch, head, positive)
        state.extras["fill_condition"] = self.__dict__.pop("_fill_condition")
        return state

    def narrow_state(self, state: DenoiseState, index: torch.Tensor) -> DenoiseState:
        """Rows `index` of the fill condition (one row per output)."""
        condition = state.extras["fill_condition"].index_select(0, index)
        return dataclasses.replace(state, extras={**state.extras, "fill_condition": condition})

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        condition = state.extras["fill_condition"]
        if condition.shape[0] != latents.shape[0]:  # a doubled CFG batch: both branches see the same rows
            condition = condition.repeat(latents.shape[0] // condition.shape[0], 1, 1)
        return super().predict(torch.cat((latents, condition), dim=2), timestep, cond, state, model_key)
