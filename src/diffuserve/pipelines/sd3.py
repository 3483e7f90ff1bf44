"""Native Stable Diffusion 3 / 3.5: diffusers' model classes and scheduler, our batched recipe.

What `diffusers.StableDiffusion3Pipeline.__call__` does, and so what this adapter does:
1. Text: two CLIP encoders with projection give their penultimate hidden states (77 tokens each,
   concatenated along features) and their pooled projections (concatenated: the `pooled_projections`);
   T5 gives `max_sequence_length` padded tokens. The CLIP features are zero-padded to T5's width and
   the two sequences concatenated along tokens. Every text pads to fixed lengths, so merged rows need
   no attention mask.
2. Guidance: classic CFG whenever `guidance_scale > 1`, with the negative prompt "" when none is
   given; one doubled transformer batch per step (negative rows first), combined as diffusers does.
   Skip-layer guidance is off in diffusers by default and is not offered here.
3. Timesteps: the checkpoint's flow-matching scheduler, `set_timesteps(steps)` with its static shift
   (and `mu` from the image token count if the scheduler enables dynamic shifting).
4. Latents: N(0, 1) noise (rows, C, H/8, W/8), one generator per row; decode divides by the VAE's
   `scaling_factor` and adds its `shift_factor`; pixels are rounded as diffusers' image processor does.

Sizes: multiples of VAE factor x patch size (16), at most `pos_embed_max_size` patches per side (the
transformer crops its positional table and cannot run beyond it: 192 x 2 x 8 = 3072 px for SD3.5).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    calculate_shift,
    retrieve_timesteps,
)
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
from diffuserve.pipelines.flux import declared_sequence_length

logger = logging.getLogger(__name__)

DIFFUSERS_MAX_SEQUENCE_LENGTH = 256
"""`StableDiffusion3Pipeline.__call__`'s default T5 length (capped by what tokenizer_3 declares)."""

REQUIRED = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
            "text_encoder_3", "tokenizer_3", "scheduler")


@dataclass
class SD3Conditioning:
    """Text conditioning of a batch (one row per output)."""

    prompt_embeds: torch.Tensor
    """(rows, 77 + T5 length, joint_attention_dim): padded CLIP features, then T5."""
    pooled: torch.Tensor
    """(rows, pooled_projection_dim): both CLIP pooled projections."""

    def rows(self, index: torch.Tensor) -> SD3Conditioning:
        return SD3Conditioning(self.prompt_embeds[index], self.pooled[index])

    @staticmethod
    def concat(a: SD3Conditioning, b: SD3Conditioning) -> SD3Conditioning:
        return SD3Conditioning(torch.cat([a.prompt_embeds, b.prompt_embeds]), torch.cat([a.pooled, b.pooled]))


@dataclass(frozen=True)
class NegativeFirstCFG:
    """CFG on one doubled batch, negative rows first, as `StableDiffusion3Pipeline` runs it (so each
    row sits where diffusers puts it and the kernels see the same batch)."""

    scale: float

    def predict(self, predict: stages.PredictFn, latents, timestep, positive, negative) -> torch.Tensor:
        both = predict(torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                       SD3Conditioning.concat(negative, positive))
        uncond, cond = both.chunk(2)
        return stages.combine_cfg(cond, uncond, self.scale)


class SD3NativePipeline(Pipeline):
    """SD3 / SD3.5 text-to-image as a batched stage pipeline."""

    family = "sd3"
    output_kind = "image"
    supports_batching = True

    def __init__(self, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.transformer = components["transformer"]
        self.vae = components["vae"]
        self.clip = (components["text_encoder"], components["text_encoder_2"])
        self.clip_tokenizers = (components["tokenizer"], components["tokenizer_2"])
        self.t5 = components["text_encoder_3"]
        self.t5_tokenizer = components["tokenizer_3"]
        self.scheduler = components["scheduler"]
        self.device = torch.device(device)
        self.dtype = dtype
        self.components = {key: components[key] for key in
                           ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae")}
        self.max_sequence_length = declared_sequence_length(self.t5_tokenizer, DIFFUSERS_MAX_SEQUENCE_LENGTH)
        """T5 tokens per text: diffusers' 256, capped by what tokenizer_3 declares."""
        self.clip_length = int(getattr(self.clip_tokenizers[0], "model_max_length", 77) or 77)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.patch_size = int(self.transformer.config.patch_size)
        self.size_multiple = self.vae_scale_factor * self.patch_size
        table = self.transformer.config.get("pos_embed_max_size")
        self.max_side = int(table) * self.size_multiple if table else None
        """Largest width/height in pixels: the positional table's side in patches x patch x VAE factor."""
        # diffusers' call defaults: the transformer's sample size in latent pixels (1024 px for the
        # real models, 64 px for the tiny one), 28 steps, guidance 7.0.
        size = int(self.transformer.config.sample_size) * self.vae_scale_factor
        self.defaults = PipelineDefaults(width=size, height=size, num_inference_steps=28, guidance_scale=7.0)
        self._schedulers: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> SD3NativePipeline:
        """Build from the loader's model_index.json key -> loaded object mapping."""
        missing = [key for key in REQUIRED if components.get(key) is None]
        if missing:
            from diffuserve.errors import CheckpointError

            raise CheckpointError(
                f"an SD3 checkpoint needs components {list(REQUIRED)}; its model_index.json lacks {missing} "
                "(use --backend diffusers for a checkpoint saved without T5)."
            )
        return cls(components, device=device, dtype=dtype)

    def validate(self, params: Any) -> None:
        super().validate(params)
        from diffuserve.errors import InvalidRequestError

        if self.max_side is not None and max(params.width, params.height) > self.max_side:
            raise InvalidRequestError(
                f"size {params.width}x{params.height} is beyond this SD3 model's positional table "
                f"({self.transformer.config.pos_embed_max_size} patches of {self.size_multiple} px per side); "
                f"width and height must be at most {self.max_side}.",
                param="size",
            )
        if params.image_inputs:
            raise InvalidRequestError(
                "image inputs (edits) are not supported for SD3 (text-to-image only).", param="image")

    def uses_cfg(self, head: Any) -> bool:
        """diffusers' rule: CFG runs whenever guidance_scale > 1 (negative prompt "" by default)."""
        return head.guidance_scale > 1.0

    # -- 1. encode --------------------------------------------------------------------------------------

    def _clip(self, index: int, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.clip_tokenizers[index](
            texts, padding="max_length", max_length=self.clip_length, truncation=True, return_tensors="pt"
        ).input_ids
        key = ("text_encoder", "text_encoder_2")[index]
        with self.residency.use(key):
            out = self.clip[index](ids.to(self.device), output_hidden_states=True)
        # The penultimate layer (diffusers' clip_skip=None), in the first encoder's dtype as upstream.
        return out.hidden_states[-2].to(self.clip[0].dtype), out[0]

    def _t5(self, texts: list[str]) -> torch.Tensor:
        ids = self.t5_tokenizer(
            texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
            add_special_tokens=True, return_tensors="pt",
        ).input_ids
        with self.residency.use("text_encoder_3"):
            return self.t5(ids.to(self.device))[0].to(self.t5.dtype)

    def encode_texts(self, texts: list[str]) -> SD3Conditioning:
        """One conditioning row per text."""
        (h1, p1), (h2, p2) = self._clip(0, texts), self._clip(1, texts)
        t5 = self._t5(texts)
        clip = torch.cat([h1, h2], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return SD3Conditioning(torch.cat([clip, t5], dim=-2), torch.cat([p1, p2], dim=-1))

    def _encode_batch(self, batch: Sequence[Any], cfg: bool) -> tuple[SD3Conditioning, SD3Conditioning | None]:
        # Prompts and negative prompts are encoded in two calls, as diffusers does: the pooled
        # projection's matmul rounds differently with the number of rows, so one joint call would
        # move a singleton's image off diffusers' by a pixel level. Within a call each distinct text
        # is encoded once and gathered to one row per output (request i's row repeated n_i times).
        def encode(texts: list[str]) -> SD3Conditioning:
            unique = list(dict.fromkeys(texts))
            encoded = self.encode_texts(unique)
            index = [unique.index(t) for t, p in zip(texts, batch, strict=True) for _ in range(p.n)]
            return encoded.rows(torch.tensor(index, device=encoded.pooled.device))

        positive = encode([p.prompt for p in batch])
        return positive, (encode([p.negative_prompt or "" for p in batch]) if cfg else None)

    # -- 2. latents and timesteps -----------------------------------------------------------------------

    def _timesteps(self, num_steps: int, image_seq_len: int) -> tuple[Any, torch.Tensor]:
        """A private scheduler with this shape's timesteps (the set-up is cached per shape)."""
        key = (num_steps, image_seq_len)
        if key not in self._schedulers:
            if len(self._schedulers) >= 64:
                self._schedulers.clear()
            template = self.scheduler.__class__.from_config(self.scheduler.config)
            cfg = template.config
            kwargs: dict[str, Any] = {}
            if cfg.get("use_dynamic_shifting", None):
                kwargs["mu"] = calculate_shift(
                    image_seq_len,
                    cfg.get("base_image_seq_len", 256),
                    cfg.get("max_image_seq_len", 4096),
                    cfg.get("base_shift", 0.5),
                    cfg.get("max_shift", 1.16),
                )
            timesteps, _ = retrieve_timesteps(template, num_steps, self.device, **kwargs)
            self._schedulers[key] = (template, timesteps)
        template, timesteps = self._schedulers[key]
        return stages.fresh_scheduler(template), timesteps

    # -- 4. decode --------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor) -> list[Image.Image]:
        """Unscale, VAE-decode and round as diffusers' image processor does."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        with self.residency.use("vae"):
            image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        array = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
        return [Image.fromarray(a) for a in (array * 255).round().astype("uint8")]

    # -- the recipe -------------------------------------------------------------------------------------

    def run(
        self,
        batch: list[Any],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> BatchResult:
        head = stages.check_batch(batch)
        cfg = self.uses_cfg(head)
        timer = stages.StageTimer()
        with torch.inference_mode():
            with timer.stage("encode"):
                positive, negative = self._encode_batch(batch, cfg)
            with timer.stage("latents"):
                lh, lw = head.height // self.vae_scale_factor, head.width // self.vae_scale_factor
                latents = stages.batch_noise(batch, (self.transformer.config.in_channels, lh, lw),
                                             device=self.device, dtype=positive.prompt_embeds.dtype)
                scheduler, timesteps = self._timesteps(
                    head.num_inference_steps, (lh // self.patch_size) * (lw // self.patch_size))

            def predict(x: torch.Tensor, timestep: torch.Tensor, cond: SD3Conditioning) -> torch.Tensor:
                return self.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond.prompt_embeds,
                                        pooled_projections=cond.pooled, return_dict=False)[0]

            guidance: stages.Guidance = NegativeFirstCFG(head.guidance_scale) if cfg else stages.NoGuidance()
            with timer.stage("denoise"), self.residency.use("transformer"):
                latents = stages.denoise(latents=latents, timesteps=timesteps, scheduler=scheduler, predict=predict,
                                         positive=positive, negative=negative, guidance=guidance,
                                         on_step=on_step, should_stop=should_stop)
            with timer.stage("decode"):
                images = self.decode(latents)
        outputs = [RequestOutput(images=rows) for rows in stages.split_rows(images, batch)]
        return BatchResult(outputs=outputs, stage_seconds=timer.seconds)
