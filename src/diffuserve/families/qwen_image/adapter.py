"""Native Qwen-Image (and 2512) and Qwen-Image 2.1 adapters, driven by the shared recipe (`RecipePipeline`).

The family parts follow `diffusers.QwenImagePipeline` / `QwenImage21Pipeline` step for step (what the
diffusers calls do is written down in `qwen_image_ops`), for a batch of requests: per-row prompts and
negative prompts, per-request seeds and `n`, one shared signature.

Prompts of different token lengths merge: Qwen-Image pads the text with a mask the transformer honours
(its RoPE places text after the image whatever the padding, so a padded row equals its singleton run).
Qwen-Image 2.1 places the image AFTER the text in its RoPE, so padding would move the image; its rows
are therefore grouped by text length and each group runs its own transformer call (equal-length rows
still share one call). The text encoders batch the same way: texts of one token length per encoder call,
so nothing is padded inside the encoder either.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor

from diffuserve.families.qwen_image import controlnet as qwen_controlnet
from diffuserve.families.qwen_image import inpaint as qwen_inpaint
from diffuserve.families.qwen_image import ops
from diffuserve.family_spec.qwen_image import QWEN_IMAGE_TEXT_TOKENS
from diffuserve.pipelines import inpaint, recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.controlnet import EXTRAS_KEY, merge_rows
from diffuserve.pipelines.prompt_limits import TextReading
from diffuserve.pipelines.recipe import Cond, DenoiseState
from diffuserve.pipelines.schedules import flow_schedule


class _QwenBase(AdapterBase):
    """What both Qwen-Image generations share: the schedule, the noise, one text encoder, the decode."""

    masked_sequences = {"embeds": "mask"}

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        scheduler: Any,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.dtype = dtype
        self.components = {"text_encoder": text_encoder, "transformer": transformer, "vae": vae}
        # The spec's facts: size multiple (VAE factor x 2x2 patches), RoPE size limit, defaults (2.1 Turbo's step
        # count from model_index.json `sample_sigmas`), continuous batching.
        self.vae_scale_factor = self.bind_facts(component_configs(self.components, self.checkpoint_index())).vae_factor
        self._schedules: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}
        # The prompt counter's framing: the prompt template around the text, its system prefix (`drop_idx`) dropped.
        framed = TextReading(
            framed_empty=lambda tokenizer: len(tokenizer(self.template.format("")).input_ids) - self.drop_idx
        )
        self.text_readings = {key: framed for key in ("tokenizer", "processor")}

    def checkpoint_folder(self) -> Path | None:
        """The checkpoint folder, found as the parent of the folder the transformer was loaded from (the
        loader hands adapters modules, not the path); None for modules built in memory."""
        origin = getattr(self.transformer.config, "_name_or_path", None)
        return Path(origin).parent if origin else None

    def checkpoint_index(self) -> dict[str, Any]:
        """The checkpoint's model_index.json: pipeline-level config such as 2.1's `sample_sigmas` (a list, which
        the loader does not pass along with the components)."""
        folder = self.checkpoint_folder()
        try:
            return json.loads((folder / "model_index.json").read_text()) if folder else {}
        except (OSError, ValueError):
            return {}

    # -- latents and schedule ---------------------------------------------------------------------------

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor * 2
        return 2 * (height // f), 2 * (width // f)

    def _noise(self, batch: Sequence[Any], channels: int, lh: int, lw: int) -> torch.Tensor:
        # diffusers draws (rows, 1, C, h, w): the frame axis of the video VAE is part of the noise shape.
        return recipe.batch_noise(batch, (1, channels, lh, lw), device=self.device, dtype=self.dtype)

    def _timesteps(
        self, num_steps: int, image_seq_len: int, grid: list[float] | None = None, flow_shift: float | None = None
    ) -> tuple[Any, torch.Tensor]:
        """A private scheduler with its timesteps set for this shape (the set-up is cached per shape and shift).
        `grid`: the checkpoint's own sigmas (2.1 Turbo) instead of diffusers' `linspace(1, 1/N, N)`."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

        return flow_schedule(
            self._schedules,
            self.scheduler,
            retrieve_timesteps,
            self.device,
            num_steps,
            flow_shift,
            shape_key=(image_seq_len,),
            sigmas=lambda config: list(grid) if grid else np.linspace(1.0, 1 / num_steps, num_steps),
            mu=lambda config: recipe.dynamic_shift_mu(config, image_seq_len),
        )

    # -- decode -------------------------------------------------------------------------------------------

    def _unscale(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        """Unpack, de-normalise with the VAE's latents mean/std, decode the single frame, round as diffusers."""
        height, width = state.extras["size"]
        latents = self._unscale(self._unpack(latents, height, width).to(self.vae.dtype))
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        return recipe.to_pil_images(image)


class QwenImageAdapter(ops.QwenPacking, _QwenBase):
    """Qwen-Image / Qwen-Image 2512 text-to-image (`QwenImagePipeline`): Qwen2.5-VL text, MM-DiT, true CFG
    rescaled to the conditional prediction's norm."""

    family = "qwen_image"
    supports_controlnet = True
    """`--controlnet` QwenImageControlNetModel rows run natively (`families/qwen_image/controlnet.py`)."""

    def __init__(self, *, tokenizer: Any, **kw: Any) -> None:
        super().__init__(**kw)
        from diffusers import QwenImagePipeline

        self.tokenizer = tokenizer
        # The prompt template and its dropped prefix are the pipeline's own constants: read them from a
        # pipeline object around the same modules (it only registers them; nothing is copied).
        reference = QwenImagePipeline(
            scheduler=self.scheduler,
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=tokenizer,
            transformer=self.transformer,
        )
        self.template = reference.prompt_template_encode
        self.drop_idx = reference.prompt_template_encode_start_idx
        self.tokenizer_max_length = reference.tokenizer_max_length
        channels = self.vae.config.z_dim
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=self.vae_scale_factor * 2, vae_latent_channels=channels
        )
        self.mask_processor = inpaint.mask_processor(self.vae_scale_factor * 2, channels)

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """The last hidden state of Qwen2.5-VL over the prompt template, system prefix dropped, padded + mask."""
        prompts = [self.template.format(t) for t in texts]
        lengths = [len(ids) for ids in self.tokenizer(prompts).input_ids]
        rows: list[torch.Tensor | None] = [None] * len(texts)
        for indices in ops.groups_by_length(lengths).values():
            tokens = self.tokenizer(
                [prompts[i] for i in indices],
                max_length=self.tokenizer_max_length + self.drop_idx,
                padding=True,
                truncation=True,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.text_encoder(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
            ).hidden_states[-1]
            for i, row in zip(
                indices,
                ops.masked_rows(hidden, tokens.attention_mask, self.drop_idx, QWEN_IMAGE_TEXT_TOKENS),
                strict=True,
            ):
                rows[i] = row
        embeds, mask = ops.pad_rows([r for r in rows if r is not None])
        return {"embeds": embeds.to(self.dtype), "mask": mask}

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        height, width = head.height, head.width
        lh, lw = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        from diffusers import QwenImagePipeline

        seq_len = (lh // 2) * (lw // 2)
        scheduler, timesteps = self._timesteps(head.num_inference_steps, seq_len, flow_shift=head.flow_shift)
        control = masked = None
        if head.image_inputs:
            latents, timesteps, masked = qwen_inpaint.prepare_inpaint_latents(
                self, batch, scheduler, timesteps, channels
            )
        elif any(p.control is not None for p in batch):
            latents, control = qwen_controlnet.prepare_control_latents(self, batch, height, width, positive, timesteps)
        else:
            noise = self._noise(batch, channels, lh, lw)
            latents = QwenImagePipeline._pack_latents(noise, noise.shape[0], channels, lh, lw)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([1], head.guidance_scale, device=self.device, dtype=torch.float32)
        extras = {
            "size": (height, width),
            "img_shapes": [[(1, lh // 2, lw // 2)]] * latents.shape[0],
            "guidance": guidance,
        }
        if control is not None:
            extras[EXTRAS_KEY] = control
        if masked is not None:
            extras[inpaint.EXTRAS_KEY] = masked
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        """The first state's extras, with every state's ControlNet rows (continuous steps)."""
        control = merge_rows([s.extras for s in states], [s.latents.shape[0] for s in states])
        if control is None:
            return states[0].extras
        return {**{k: v for k, v in states[0].extras.items() if not k.startswith("_")}, EXTRAS_KEY: control}

    # -- inpainting (QwenImageInpaintPipeline; pipelines/inpaint.py, families/qwen_image/inpaint.py) -----------

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        """The scheduler's step, then (inpainting rows) the kept region put back."""
        return inpaint.blended_step(noise_pred, timestep, latents, state)

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        return inpaint.apply_overlays(super().decode(latents, state), state, self.image_processor)

    def narrow_state(self, state: DenoiseState, index: torch.Tensor) -> DenoiseState:
        """Rows `index` of the image shapes (edits of different strengths)."""
        return qwen_inpaint.narrow_state(self, state, index)

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        if "packed" in state.extras:
            return self.predict_packed(latents, timestep, cond, state)
        mask = cond["mask"]
        guidance = state.extras["guidance"]
        control = qwen_controlnet.controlnet_kwargs(self, latents, timestep, state.extras)
        return self.transformer(
            hidden_states=latents,
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None if guidance is None else guidance.expand(latents.shape[0]),
            # diffusers passes no mask when nothing is padded (the attention then runs unmasked).
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            encoder_hidden_states=cond["embeds"],
            img_shapes=state.extras["img_shapes"],
            return_dict=False,
            **control,
        )[0]

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: Any, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        return ops.norm_rescaled_cfg(cond, uncond, self.guidance_rule.scale(head))

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        from diffusers import QwenImagePipeline

        return QwenImagePipeline._unpack_latents(latents, height, width, self.vae_scale_factor)

    def _unscale(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = ops.latents_stats(self.vae, latents)
        return latents / (1.0 / std) + mean


class QwenImage21Adapter(_QwenBase):
    """Qwen-Image 2.1 text-to-image (`QwenImage21Pipeline`): Qwen3-VL text, single-stream block-causal DiT
    with a prefix KV cache, plain true CFG (off by default)."""

    family = "qwen_image_21"

    def __init__(self, *, processor: Any, **kw: Any) -> None:
        super().__init__(**kw)
        from diffusers import QwenImage21Pipeline

        self.processor = processor
        # Turbo checkpoints carry their sampling grid in model_index.json (`sample_sigmas`).
        self.sample_sigmas = self.checkpoint_index().get("sample_sigmas") or None
        reference = QwenImage21Pipeline(
            scheduler=self.scheduler,
            vae=self.vae,
            text_encoder=self.text_encoder,
            processor=processor,
            transformer=self.transformer,
        )
        self.template = reference.prompt_template_t2i
        self.drop_idx = reference._drop_idx
        # What `family_spec/qwen_image.check_qwen_image_21` reads: the template and its dropped prefix (it counts the
        # templated prompt against the RoPE table's text positions) and a Turbo checkpoint's fixed step count.
        grid = len(self.sample_sigmas) if self.sample_sigmas else None
        self.family_facts = {"prompt_template": self.template, "drop_idx": self.drop_idx, "grid_steps": grid}
        self._norm = getattr(self.text_encoder.model, "language_model", self.text_encoder.model).norm

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """Qwen3-VL's last decoder layer BEFORE its final norm (as diffusers reads it), system prefix dropped."""
        # Qwen has no bos token: an empty prompt would leave the encoder nothing to read.
        prompts = [self.template.format(t or " ") for t in texts]
        lengths = [len(ids) for ids in self.processor.tokenizer(prompts).input_ids]
        rows: list[torch.Tensor | None] = [None] * len(texts)
        for indices in ops.groups_by_length(lengths).values():
            inputs = self.processor(
                text=[prompts[i] for i in indices], padding=True, padding_side="left", return_tensors="pt"
            ).to(self.device)
            kwargs = {
                "input_ids": inputs.input_ids,
                "attention_mask": inputs.attention_mask,
                "output_hidden_states": True,
            }
            if "mm_token_type_ids" in inputs:
                kwargs["mm_token_type_ids"] = inputs.mm_token_type_ids
            handle = self._norm.register_forward_hook(lambda module, args, output: args[0])
            try:
                hidden = self.text_encoder(**kwargs).hidden_states[-1]
            finally:
                handle.remove()
            for i, row in zip(indices, ops.masked_rows(hidden, inputs.attention_mask, self.drop_idx), strict=True):
                rows[i] = row
        embeds, mask = ops.pad_rows([r for r in rows if r is not None])
        return {"embeds": embeds.to(self.dtype), "mask": mask}

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        from diffusers import QwenImage21Pipeline

        height, width = head.height, head.width
        lh, lw = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels
        noise = self._noise(batch, channels, lh, lw)
        latents = QwenImage21Pipeline._pack_latents(noise, noise.shape[0], channels, lh, lw)
        scheduler, timesteps = self._timesteps(
            head.num_inference_steps, latents.shape[1], self.sample_sigmas, head.flow_shift
        )
        extras = {"size": (height, width), "img_shape": (1, lh, lw), "kv": []}
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def _cache(self, state: DenoiseState, embeds: torch.Tensor, length: int) -> tuple[Any, str]:
        """The prefix KV cache of this conditioning's rows of one text length, and the mode to call with.

        The recipe hands the same conditioning tensors to every step, so a cache found for them was filled
        on an earlier step ("cached"); a new one is filled now ("extract"). A miss only costs speed: with
        `causal_condition` the prefix does not depend on the step, so extract equals cached."""
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        for owner, owner_length, cache in state.extras["kv"]:
            if owner is embeds and owner_length == length:
                return cache, "cached"
        cache = QwenImage21KVCache(len(self.transformer.transformer_blocks))
        state.extras["kv"].append((embeds, length, cache))
        return cache, "extract"

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        embeds, lengths = cond["embeds"], cond["mask"].sum(dim=1).tolist()
        caching = bool(self.transformer.config.causal_condition)
        out = torch.empty_like(latents)
        for length, rows in ops.groups_by_length(lengths).items():
            index = torch.tensor(rows, device=latents.device)
            n = len(rows)
            # Text slots, then one image slot per 2x2 target tokens (the transformer reads row 0's layout).
            img_mask = torch.cat(
                [
                    torch.zeros(n, length, dtype=torch.bool, device=latents.device),
                    torch.ones(n, latents.shape[1] // 4, dtype=torch.bool, device=latents.device),
                ],
                dim=1,
            )
            cache, mode = self._cache(state, embeds, length) if caching else (None, None)
            pred = self.transformer(
                hidden_states=latents[index],
                timestep=timestep[index].to(latents.dtype) / 1000,
                encoder_hidden_states=embeds[index, :length],
                encoder_hidden_states_mask=None,
                img_shapes=[[state.extras["img_shape"]]] * n,
                img_mask=img_mask,
                kv_cache=cache,
                kv_cache_mode=mode,
                return_dict=False,
            )[0]
            out[index] = pred[:, -latents.shape[1] :]
        return out

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        from diffusers import QwenImage21Pipeline

        return QwenImage21Pipeline._unpack_latents(latents, height, width, self.vae_scale_factor)

    def _unscale(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = ops.latents_stats(self.vae, latents)
        return latents * std + mean
