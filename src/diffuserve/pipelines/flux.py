"""Native FLUX.1 pipeline: diffusers' model classes and scheduler, our batched stage recipe.

The recipe follows `diffusers.FluxPipeline` step for step (so outputs match it) but takes a batch of
requests: per-row prompts, per-request seeds and `n`, one shared signature (size, steps, guidance).
What is constant per shape (image position ids, text ids, the scheduler's timesteps) is cached, and
there is no progress bar or input re-tokenisation, which is where the speed over diffusers comes from.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift, retrieve_timesteps
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from diffuserve.pipelines import stages
from diffuserve.pipelines.base import (
    BatchResult,
    Pipeline,
    PipelineDefaults,
    RequestOutput,
    StepCallback,
    StopCheck,
)
from diffuserve.pipelines.prompt_limits import TextEncoderLimit

logger = logging.getLogger(__name__)

MAX_CACHED_SHAPES = 64
"""Per-shape caches (position ids, timesteps) are cleared past this many entries, so a stream of
requests with ever new sizes or step counts cannot grow memory without bound."""

COMPONENT_KEYS = ("text_encoder", "text_encoder_2", "transformer", "vae")
"""model_index.json keys of the modules this pipeline runs (the residency manager's components)."""


def declared_sequence_length(tokenizer: Any, default: int) -> int:
    """`default`, capped by the tokenizer's declared `model_max_length` (the longest text the checkpoint
    was made for; real FLUX.1 declares 512, so it gets diffusers' default unchanged)."""
    declared = getattr(tokenizer, "model_max_length", None)
    return min(default, int(declared)) if isinstance(declared, int) and declared > 0 else default


def _make_room(cache: dict) -> None:
    if len(cache) >= MAX_CACHED_SHAPES:
        cache.clear()


@dataclass
class FluxConditioning:
    """Text conditioning of a batch (one row per output)."""

    prompt_embeds: torch.Tensor
    """T5 hidden states, (rows, seq, joint_attention_dim)."""
    pooled: torch.Tensor
    """CLIP pooled output, (rows, pooled_projection_dim)."""

    @staticmethod
    def concat(a: FluxConditioning, b: FluxConditioning) -> FluxConditioning:
        return FluxConditioning(
            torch.cat([a.prompt_embeds, b.prompt_embeds]), torch.cat([a.pooled, b.pooled])
        )


class FluxNativePipeline(Pipeline):
    """FLUX.1 text-to-image (dev and schnell style) as a batched stage pipeline."""

    family = "flux"
    output_kind = "image"
    supports_batching = True

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
        batched_cfg: bool = False,
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
        self.batched_cfg = batched_cfg
        """Run true CFG as one doubled batch instead of two passes (diffusers does two passes)."""
        self.components = {
            "text_encoder": text_encoder,
            "text_encoder_2": text_encoder_2,
            "transformer": transformer,
            "vae": vae,
        }
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        # FLUX packs 2x2 latent patches into tokens, so sizes must divide by the VAE factor times 2.
        self.size_multiple = self.vae_scale_factor * 2
        self.defaults = self._defaults_from_checkpoint()
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2,
                                                 vae_latent_channels=vae.config.latent_channels)
        self._clip_max_length = getattr(tokenizer, "model_max_length", 77) or 77
        self._image_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._text_ids: dict[int, torch.Tensor] = {}
        self._schedulers: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}

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

    def _defaults_from_checkpoint(self) -> PipelineDefaults:
        # Size: the VAE's `sample_size` is the training resolution in pixels (1024 for FLUX.1), which
        # is also what diffusers' default (128 latent px x vae factor 8) gives there; for tiny
        # checkpoints it is their small native size instead of an expensive 1024.
        size = int(getattr(self.vae.config, "sample_size", 0) or 128 * self.vae_scale_factor)
        size = max(self.size_multiple, size // self.size_multiple * self.size_multiple)
        # dev (guidance-distilled, embedded guidance) wants ~28 steps at 3.5; schnell 4 steps, no guidance.
        if getattr(self.transformer.config, "guidance_embeds", False):
            return PipelineDefaults(width=size, height=size, num_inference_steps=28, guidance_scale=3.5)
        return PipelineDefaults(width=size, height=size, num_inference_steps=4, guidance_scale=0.0)

    # -- 1. encode prompts ----------------------------------------------------------------------------

    def prompt_token_limits(self) -> list[TextEncoderLimit]:
        """What each text encoder takes (the server warns about longer prompts: pipelines/prompt_limits.py)."""
        return [TextEncoderLimit("text_encoder (CLIP)", self.tokenizer, self._clip_max_length),
                TextEncoderLimit("text_encoder_2 (T5)", self.tokenizer_2, self.max_sequence_length)]

    def _clip_pooled(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self._clip_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        with self.residency.use("text_encoder"):
            out = self.text_encoder(ids.to(self.device), output_hidden_states=False)
        return out.pooler_output.to(self.dtype)

    def _t5_embeds(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer_2(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        with self.residency.use("text_encoder_2"):
            out = self.text_encoder_2(ids.to(self.device), output_hidden_states=False)[0]
        return out.to(self.dtype)

    def encode_prompts(self, prompts: list[str]) -> FluxConditioning:
        """One conditioning row per prompt (CLIP pooled + T5 sequence)."""
        return FluxConditioning(prompt_embeds=self._t5_embeds(prompts), pooled=self._clip_pooled(prompts))

    def _encode_batch(
        self, batch: Sequence[Any], cfg: bool
    ) -> tuple[FluxConditioning, FluxConditioning | None]:
        # Each distinct text is encoded once (positive and negative prompts in one encoder call),
        # then gathered to one row per output: request i's row repeated n_i times, as diffusers does
        # for num_images_per_prompt. Encoding is per row, so deduplication cannot change a row.
        texts = [p.prompt for p in batch]
        if cfg:
            texts += [p.negative_prompt or "" for p in batch]
        unique = list(dict.fromkeys(texts))
        encoded = self.encode_prompts(unique)
        slot = {text: i for i, text in enumerate(unique)}
        counts = [p.n for p in batch]

        def rows(part: list[str]) -> FluxConditioning:
            index = torch.tensor([slot[t] for t, n in zip(part, counts, strict=True) for _ in range(n)])
            index = index.to(encoded.pooled.device)
            return FluxConditioning(encoded.prompt_embeds[index], encoded.pooled[index])

        k = len(batch)
        return rows(texts[:k]), (rows(texts[k:]) if cfg else None)

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
        timesteps = timesteps[t_start * scheduler.order:]
        scheduler.set_begin_index(t_start * scheduler.order)
        lh, lw = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        rows = []
        for params in batch:
            generators = [torch.Generator("cpu").manual_seed(s) for s in stages.row_seeds(params)]
            source = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB")
            pixels = self.image_processor.preprocess(source, height=height, width=width)
            with self.residency.use("vae"):
                encoded = self.vae.encode(pixels.to(self.device, self.vae.dtype))
            image_latents = retrieve_latents(encoded, generator=generators[0])
            image_latents = (image_latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor
            noise = randn_tensor((params.n, channels, lh, lw), generator=generators, device=self.device, dtype=self.dtype)
            start = timesteps[:1].repeat(params.n)
            rows.append(scheduler.scale_noise(image_latents.to(self.dtype).expand(params.n, -1, -1, -1), start, noise))
        latents = torch.cat(rows)
        return FluxPipeline._pack_latents(latents, latents.shape[0], channels, lh, lw), timesteps

    def validate(self, params: Any) -> None:
        super().validate(params)
        if params.image_inputs:
            from diffuserve.errors import InvalidRequestError

            if not 0.0 < params.strength <= 1.0:
                raise InvalidRequestError(f"strength={params.strength} must be in (0, 1].", param="strength")
            if int(params.num_inference_steps * params.strength) < 1:
                raise InvalidRequestError(
                    f"strength={params.strength} with num_inference_steps={params.num_inference_steps} leaves no "
                    "denoising step; raise strength or num_inference_steps.", param="strength")

    def _image_ids_for(self, height: int, width: int) -> torch.Tensor:
        key = (height, width)
        if key not in self._image_ids:
            _make_room(self._image_ids)
            lh, lw = self._latent_hw(height, width)
            self._image_ids[key] = FluxPipeline._prepare_latent_image_ids(
                1, lh // 2, lw // 2, self.device, self.dtype
            )
        return self._image_ids[key]

    def _text_ids_for(self, seq_len: int) -> torch.Tensor:
        if seq_len not in self._text_ids:
            _make_room(self._text_ids)
            self._text_ids[seq_len] = torch.zeros(seq_len, 3, device=self.device, dtype=self.dtype)
        return self._text_ids[seq_len]

    def _timesteps(self, num_steps: int, image_seq_len: int) -> tuple[Any, torch.Tensor]:
        """A private scheduler with its timesteps set for this shape (the set-up is cached per shape)."""
        key = (num_steps, image_seq_len)
        if key not in self._schedulers:
            _make_room(self._schedulers)
            template = self.scheduler.__class__.from_config(self.scheduler.config)
            cfg = template.config
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
            if getattr(cfg, "use_flow_sigmas", False):
                sigmas = None
            mu = calculate_shift(
                image_seq_len,
                cfg.get("base_image_seq_len", 256),
                cfg.get("max_image_seq_len", 4096),
                cfg.get("base_shift", 0.5),
                cfg.get("max_shift", 1.15),
            )
            timesteps, _ = retrieve_timesteps(template, num_steps, self.device, sigmas=sigmas, mu=mu)
            self._schedulers[key] = (template, timesteps)
        template, timesteps = self._schedulers[key]
        return stages.fresh_scheduler(template), timesteps

    # -- 4. decode --------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        """Unpack, unscale and VAE-decode; returns PIL images (the same rounding as diffusers)."""
        latents = FluxPipeline._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        with self.residency.use("vae"):
            image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        array = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
        array = (array * 255).round().astype("uint8")
        return [Image.fromarray(a) for a in array]

    # -- the recipe -------------------------------------------------------------------------------------

    def run(
        self,
        batch: list[Any],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> BatchResult:
        head = stages.check_batch(batch)
        height, width = head.height, head.width
        cfg = head.cfg_enabled
        timer = stages.StageTimer()
        with torch.inference_mode():
            # 1. Encode prompts (and negative prompts when true CFG runs).
            with timer.stage("encode"):
                positive, negative = self._encode_batch(batch, cfg)

            # 2. Prepare latents: per-request seeds, then the cached position ids and timesteps.
            #    Image-conditioned requests (edits) start from their re-noised input image instead.
            with timer.stage("latents"):
                lh, lw = self._latent_hw(height, width)
                scheduler, timesteps = self._timesteps(head.num_inference_steps, (lh // 2) * (lw // 2))
                if head.image_inputs:
                    latents, timesteps = self.prepare_image_latents(batch, height, width, scheduler, timesteps)
                else:
                    latents = self.prepare_latents(batch, height, width)
                img_ids = self._image_ids_for(height, width)
                txt_ids = self._text_ids_for(positive.prompt_embeds.shape[1])
                guidance_vec = None
                if self.transformer.config.guidance_embeds:
                    guidance_vec = torch.full(
                        [1], head.guidance_scale, device=self.device, dtype=torch.float32
                    )

            # 3. Denoise: the shared loop, with this family's transformer call.
            def predict(x: torch.Tensor, timestep: torch.Tensor, cond: FluxConditioning) -> torch.Tensor:
                return self.transformer(
                    hidden_states=x,
                    timestep=timestep / 1000,
                    guidance=None if guidance_vec is None else guidance_vec.expand(x.shape[0]),
                    pooled_projections=cond.pooled,
                    encoder_hidden_states=cond.prompt_embeds,
                    txt_ids=txt_ids,
                    img_ids=img_ids,
                    return_dict=False,
                )[0]

            guidance: stages.Guidance = stages.NoGuidance()
            if cfg and self.batched_cfg:
                guidance = stages.BatchedCFG(head.true_cfg_scale, FluxConditioning.concat)
            elif cfg:
                guidance = stages.SequentialCFG(head.true_cfg_scale)
            with timer.stage("denoise"), self.residency.use("transformer"):
                latents = stages.denoise(
                    latents=latents,
                    timesteps=timesteps,
                    scheduler=scheduler,
                    predict=predict,
                    positive=positive,
                    negative=negative,
                    guidance=guidance,
                    on_step=on_step,
                    should_stop=should_stop,
                )

            # 4. Decode and split the rows back per request.
            with timer.stage("decode"):
                images = self.decode(latents, height, width)
        outputs = [RequestOutput(images=rows) for rows in stages.split_rows(images, batch)]
        return BatchResult(outputs=outputs, stage_seconds=timer.seconds)
