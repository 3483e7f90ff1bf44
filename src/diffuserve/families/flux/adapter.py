"""Native FLUX.1 pipeline: diffusers' model classes and scheduler on the shared recipe (`stages.RecipePipeline`).

The family parts follow `diffusers.FluxPipeline` step for step (so outputs match it) for a batch of
requests: per-row prompts, per-request seeds and `n`, one shared signature (size, steps, guidance).
What is constant per shape (image position ids, text ids, the scheduler's timesteps) is cached, and
there is no progress bar or input re-tokenisation, which is where the speed over diffusers comes from.
"""

from __future__ import annotations

import io
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

from diffuserve.pipelines import packing, stages, token_ids
from diffuserve.pipelines.base import component_configs, declared_sequence_length
from diffuserve.pipelines.stages import Cond, DenoiseState

logger = logging.getLogger(__name__)

MAX_CACHED_SHAPES = 64
"""Per-shape caches (position ids, timesteps) are cleared past this many entries, so a stream of
requests with ever new sizes or step counts cannot grow memory without bound."""


def _make_room(cache: dict) -> None:
    if len(cache) >= MAX_CACHED_SHAPES:
        cache.clear()


class FluxNativePipeline(stages.RecipePipeline):
    """FLUX.1 text-to-image (dev and schnell style) as a batched stage pipeline. Its static facts (size multiple,
    dev/schnell defaults, continuous, text encoders) are the family spec's (`families/flux/spec.py`, `bind_facts`)."""

    family = "flux"

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
        self._clip_max_length = getattr(tokenizer, "model_max_length", 77) or 77
        self._image_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._text_ids: dict[int, torch.Tensor] = {}
        self._schedulers: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> FluxNativePipeline:
        """Build from the loader's model_index.json key -> loaded object mapping."""
        required = (
            "transformer",
            "vae",
            "text_encoder",
            "tokenizer",
            "text_encoder_2",
            "tokenizer_2",
            "scheduler",
        )
        missing = [key for key in required if components.get(key) is None]
        if missing:
            from diffuserve.errors import CheckpointError

            raise CheckpointError(
                f"a FLUX.1 checkpoint needs components {list(required)}; its model_index.json lacks {missing} "
                "(use --backend diffusers for a pipeline without them)."
            )
        return cls(
            transformer=components["transformer"],
            vae=components["vae"],
            text_encoder=components["text_encoder"],
            tokenizer=components["tokenizer"],
            text_encoder_2=components["text_encoder_2"],
            tokenizer_2=components["tokenizer_2"],
            scheduler=components["scheduler"],
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
        noise = stages.batch_noise(batch, (channels, lh, lw), device=self.device, dtype=self.dtype)
        return FluxPipeline._pack_latents(noise, noise.shape[0], channels, lh, lw)

    def prepare_image_latents(
        self, batch: Sequence[Any], height: int, width: int, scheduler: Any, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Image-to-image start: each request's input image, VAE-encoded and re-noised to `strength`.

        Follows diffusers' FluxImg2ImgPipeline: the schedule starts at step `steps - steps*strength`;
        a request's row generators sample its image latents (row 0's generator) and then draw one
        noise row each, so a request's rows are the same alone or in a batch.
        """
        head = batch[0]
        num_steps = len(timesteps)
        t_start = int(max(num_steps - min(num_steps * head.strength, num_steps), 0))
        timesteps = timesteps[t_start * scheduler.order :]
        scheduler.set_begin_index(t_start * scheduler.order)
        lh, lw = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        rows = []
        for params in batch:
            generators = [torch.Generator("cpu").manual_seed(s) for s in stages.row_seeds(params)]
            source = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB")
            pixels = self.image_processor.preprocess(source, height=height, width=width)
            encoded = self.vae.encode(pixels.to(self.device, self.vae.dtype))
            image_latents = retrieve_latents(encoded, generator=generators[0])
            image_latents = (image_latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor
            noise = randn_tensor(
                (params.n, channels, lh, lw), generator=generators, device=self.device, dtype=self.dtype
            )
            start = timesteps[:1].repeat(params.n)
            rows.append(scheduler.scale_noise(image_latents.to(self.dtype).expand(params.n, -1, -1, -1), start, noise))
        latents = torch.cat(rows)
        return FluxPipeline._pack_latents(latents, latents.shape[0], channels, lh, lw), timesteps

    def request_fields(self) -> frozenset[str]:
        return frozenset({"true_cfg_scale", *(("flow_shift",) if stages.has_flow_shift(self.scheduler) else ())})

    def validate(self, params: Any) -> None:
        super().validate(params)
        if params.image_inputs:
            from diffuserve.errors import InvalidRequestError

            if not 0.0 < params.strength <= 1.0:
                raise InvalidRequestError(f"strength={params.strength} must be in (0, 1].", param="strength")
            if int(params.num_inference_steps * params.strength) < 1:
                raise InvalidRequestError(
                    f"strength={params.strength} with num_inference_steps={params.num_inference_steps} leaves no "
                    "denoising step; raise strength or num_inference_steps.",
                    param="strength",
                )

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

        def build() -> tuple[Any, torch.Tensor]:
            template = stages.scheduler_template(self.scheduler, flow_shift)
            sigmas = (
                None
                if getattr(template.config, "use_flow_sigmas", False)
                else np.linspace(1.0, 1 / num_steps, num_steps)
            )
            mu = stages.dynamic_shift_mu(template.config, image_seq_len)
            return template, retrieve_timesteps(template, num_steps, self.device, sigmas=sigmas, mu=mu)[0]

        return stages.cached_schedule(self._schedulers, (num_steps, image_seq_len, flow_shift), build)

    # -- 4. decode --------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """Unpack, unscale and VAE-decode; returns PIL images (the same rounding as diffusers)."""
        height, width = state.extras["size"]
        latents = FluxPipeline._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return stages.to_pil_images(image)

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        # Keep the step's velocity for `preview` (a reference, no copy; the final latents are unchanged).
        state.extras["velocity"] = noise_pred
        return super().scheduler_step(noise_pred, timestep, latents, state)

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
        if head.image_inputs:
            latents, timesteps = self.prepare_image_latents(batch, height, width, scheduler, timesteps)
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
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        if "packed" in state.extras:
            return self.predict_packed(latents, timestep, cond, state)
        guidance = state.extras["guidance"]
        return self.transformer(
            hidden_states=latents,
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None if guidance is None else guidance.expand(latents.shape[0]),
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=state.extras["txt_ids"],
            img_ids=state.extras["img_ids"],
            return_dict=False,
        )[0]

    # -- packed mixed-size calls (pipelines/packing.py) -------------------------------------------------------

    def packed_layout(self, groups: list[packing.SizeGroup], positive: Cond) -> packing.PackedRows:
        """[T5 text, image] per row: every row's text is the same padded length (T5 pads to its max length and
        FLUX.1 attends to the padding, as diffusers does); the image tokens differ by size."""
        text = positive["prompt_embeds"].shape[1]
        image = [g.tokens for g in groups for _ in range(g.rows.stop - g.rows.start)]
        kernel = packing.packed_kernel(self.device)
        return packing.PackedRows((text,) * len(image), tuple(image), text, max(image), kernel=kernel)

    def packed_extras(
        self, groups: list[packing.SizeGroup], layout: packing.PackedRows, positive: Cond
    ) -> dict[str, object]:
        """Each row's own position ids ([text ids, its size's image ids, zeros for the padding]), stacked."""
        text_ids = self._text_ids_for(layout.max_text)
        ids = []
        for g in groups:
            image_ids = self._image_ids_for(*g.state.extras["size"])
            pad = text_ids.new_zeros(layout.max_image - image_ids.shape[0], 3)
            ids += [torch.cat([text_ids, image_ids, pad])] * (g.rows.stop - g.rows.start)
        return {"ids": torch.cat(ids), "guidance": groups[0].state.extras["guidance"]}

    def predict_packed(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState
    ) -> torch.Tensor:
        """One transformer call over rows of different sizes: per-row RoPE tables (stacked, applied per row by
        `packing.install_row_rotary`), a key mask (or flex block mask) confining each row to its own tokens, and
        the per-row timestep / guidance / pooled modulation diffusers already broadcasts per row."""
        packing.install_row_rotary("diffusers.models.transformers.transformer_flux")
        layout: packing.PackedRows = state.extras["packed"].layout
        repeats = latents.shape[0] // layout.rows  # 2 for a doubled CFG batch
        ids = state.extras["ids"].repeat(repeats, 1)
        guidance = state.extras["guidance"]
        with layout.active():
            out = self.transformer(
                hidden_states=latents,
                timestep=timestep.to(latents.dtype) / 1000,
                guidance=None if guidance is None else guidance.expand(latents.shape[0]),
                pooled_projections=cond["pooled"],
                encoder_hidden_states=cond["prompt_embeds"],
                txt_ids=ids[:0],
                img_ids=ids,
                joint_attention_kwargs={"attention_mask": layout.attention_mask(repeats, latents.device)},
                return_dict=False,
            )[0]
        return out * layout.image_mask(repeats, out.device)[..., None].to(out.dtype)
