"""Native Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit 2509/2511 (`QwenImageEditPlusPipeline`).

The family parts follow the diffusers pipelines step for step, so a request and a diffusers call with the same
image(s), prompt, size, steps, `true_cfg_scale`, negative prompt and seeds give the same pixels:

- Condition images. Edit resizes its one input to about 1024x1024 (same aspect, sides multiples of 32) and
  uses that picture twice: the Qwen2.5-VL processor sees it beside the prompt, the VAE encodes it. EditPlus
  resizes each input twice: to about 384x384 for the processor and 1024x1024 for the VAE.
- Prompt. The pipeline's chat template, with one `<|vision_start|><|image_pad|><|vision_end|>` block (Edit, in
  front of the instruction) or one `Picture i: ...` block per image (EditPlus); the encoder's last hidden
  state with the 64 system-prompt tokens dropped. Every text (prompt, negative prompt) is encoded alone, as
  diffusers does, so no padding ever enters the encoder.
- Latents. The noise tokens (one row per output) are followed on the sequence by the packed latents of every
  input image (shared by the rows); `img_shapes` lists the output grid and then each input's grid; only the
  noise tokens' prediction is kept.
- Guidance. True CFG in two passes with Qwen-Image's norm rescale: the combined prediction is scaled back to
  the per-token norm of the conditional one.
- Output. Unpack, un-normalise with the VAE's latents_mean/std, decode frame 0, diffusers' postprocess.

- Masks (`QwenImageEditInpaintPipeline`): the output is the image's ~1024² size (diffusers ignores height and
  width; we refuse another `size`); the image resized to it (and cropped with `padding_mask_crop`) is encoded
  once (sampled with row 0's generator) and is both the conditioning tokens and Qwen-Image inpainting's start
  re-noised to `strength` (families/qwen_image/inpaint.py); after each step the kept region is put back and a
  crop pasted back (pipelines/inpaint.py). The prompt sees the whole resized image, as the edit does.

Edits never merge across requests (the server marks them `image_conditioning`); `n` outputs of one edit
share one call, row j seeded `seed + j`, which is diffusers with `num_images_per_prompt=n` and one generator
per row.
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
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module
from PIL import Image

from diffuserve.families.qwen_image import inpaint as qwen_inpaint
from diffuserve.families.qwen_image.ops import latents_stats, norm_rescaled_cfg, pad_rows
from diffuserve.pipelines import inpaint, recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.recipe import Cond, DenoiseState
from diffuserve.pipelines.schedules import flow_schedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EditInputs:
    """One request's input images, prepared as the diffusers pipeline prepares them."""

    prompt_images: list[Image.Image]
    """What the Qwen2.5-VL processor sees beside the prompt (Edit: ~1024²; EditPlus: ~384² each)."""
    vae_pixels: list[torch.Tensor]
    """What the VAE encodes, one (1, 3, 1, H, W) tensor in [-1, 1] per input (~1024² each)."""
    vae_sizes: list[tuple[int, int]]
    """(width, height) of each VAE input."""


class QwenImageEditAdapter(AdapterBase):
    """Qwen-Image-Edit: one input image, the instruction encoded together with it."""

    family = "qwen_image_edit"
    masked_sequences = {"prompt_embeds": "prompt_mask"}
    min_image_inputs = 1
    multi_image = False
    """The processor gets a list of images (EditPlus) rather than one image (Edit)."""
    diffusers_module: Any = edit_module
    """The diffusers module whose pipeline this adapter reproduces (templates, size rules, helpers)."""

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        processor: Any,
        scheduler: Any,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.processor = processor
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.dtype = dtype
        self.components = {"text_encoder": text_encoder, "transformer": transformer, "vae": vae}
        # The spec's facts: latents packed in 2x2 patches, so sizes divide by the VAE factor times 2 (diffusers
        # rounds down to this; we refuse other sizes instead, naming `size`); the RoPE size limit; the defaults.
        self.vae_scale_factor = self.bind_facts(component_configs(self.components)).vae_factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.mask_processor = inpaint.mask_processor(self.vae_scale_factor * 2, vae.config.z_dim)
        pipe_class = getattr(self.diffusers_module, self._diffusers_class_name())
        # The prompt encoding (chat template, image blocks, dropped system prefix) is the diffusers pipeline's
        # own method on an instance that holds only the text encoder and the processor (the same objects, so
        # residency hooks on the encoder apply).
        self._prompt_encoder = pipe_class(
            scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=None, processor=processor, transformer=None
        )
        self._schedules: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}
        self._inputs: tuple[tuple[bytes, ...], EditInputs] | None = None
        """The request's prepared input images, made by `encode_text` and taken by `prepare` (`_edit_inputs`)."""

    @classmethod
    def _diffusers_class_name(cls) -> str:
        return "QwenImageEditPipeline"

    # -- input images ------------------------------------------------------------------------------------------

    def prepare_inputs(self, images: list[Image.Image]) -> EditInputs:
        """Edit: one ~1024² resize, shown to the processor and encoded by the VAE."""
        image = images[0]
        width, height, _ = self.diffusers_module.calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])
        resized = self.image_processor.resize(image, height, width)
        pixels = self.image_processor.preprocess(resized, height, width).unsqueeze(2)
        return EditInputs(prompt_images=[resized], vae_pixels=[pixels], vae_sizes=[(width, height)])

    def _edit_inputs(self, head: Any) -> EditInputs:
        # encode_text and prepare both need the request's prepared images; prepare them once per request.
        key = tuple(head.image_inputs)
        if self._inputs is None or self._inputs[0] != key:
            images = [Image.open(io.BytesIO(data)).convert("RGB") for data in key]
            self._inputs = (key, self.prepare_inputs(images))
        return self._inputs[1]

    # -- 1. encode -------------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """The instruction(s) encoded with the input image(s), through the diffusers pipeline's own prompt
        encoder (its template, image blocks and dropped system prefix). Each text is encoded alone, as
        diffusers encodes the prompt and the negative prompt, so no padding enters the encoder."""
        inputs = self._edit_inputs(batch[0])
        images: Any = inputs.prompt_images if self.multi_image else inputs.prompt_images[0]
        rows = [
            self._prompt_encoder._get_qwen_prompt_embeds(text, images, self.device, self.text_encoder.dtype)[0][0]
            for text in texts
        ]
        embeds, mask = pad_rows(rows)
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    # -- 2. latents, schedule, image latents ---------------------------------------------------------------

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return 2 * (height // (self.vae_scale_factor * 2)), 2 * (width // (self.vae_scale_factor * 2))

    def _schedule(
        self, num_steps: int, image_seq_len: int, flow_shift: float | None = None
    ) -> tuple[Any, torch.Tensor]:
        """A private scheduler with timesteps set as the pipeline sets them (cached per shape and shift)."""

        return flow_schedule(
            self._schedules,
            self.scheduler,
            self.diffusers_module.retrieve_timesteps,
            self.device,
            num_steps,
            flow_shift,
            shape_key=(image_seq_len,),
            sigmas=lambda config: np.linspace(1.0, 1 / num_steps, num_steps),
            mu=lambda config: recipe.dynamic_shift_mu(config, image_seq_len),
        )

    def _image_latents(self, inputs: EditInputs, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Every input image VAE-encoded (distribution mode), normalised, repeated per row, packed, concatenated."""
        channels = self.transformer.config.in_channels // 4
        packed = []
        for pixels in inputs.vae_pixels:
            encoded = self.vae.encode(pixels.to(device=self.device, dtype=dtype))
            latents = edit_module.retrieve_latents(encoded, sample_mode="argmax")
            mean, std = latents_stats(self.vae, latents)
            latents = (latents - mean) / std
            latents = torch.cat([latents] * rows, dim=0)
            lh, lw = latents.shape[3:]
            packed.append(edit_module.QwenImageEditPipeline._pack_latents(latents, rows, channels, lh, lw))
        return torch.cat(packed, dim=1)

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        """Noise rows (row j of a request from `seed + j`), the input images' latents, img_shapes, schedule."""
        inputs = self._edit_inputs(head)
        # `encode_text` and this are the only readers of the prepared ~1024² inputs, in that order, on the thread
        # that runs the batch: do not hold them beyond the request.
        self._inputs = None
        if head.mask_input is not None:
            return self._prepare_inpaint(batch, head)
        rows = recipe.num_rows(batch)
        dtype = positive["prompt_embeds"].dtype
        lh, lw = self._latent_hw(head.height, head.width)
        channels = self.transformer.config.in_channels // 4
        noise = recipe.batch_noise(batch, (1, channels, lh, lw), device=self.device, dtype=dtype)
        latents = edit_module.QwenImageEditPipeline._pack_latents(noise, rows, channels, lh, lw)
        image_latents = self._image_latents(inputs, rows, dtype)
        f = self.vae_scale_factor
        shapes = [(1, lh // 2, lw // 2), *[(1, h // f // 2, w // f // 2) for w, h in inputs.vae_sizes]]
        scheduler, timesteps = self._schedule(head.num_inference_steps, latents.shape[1], head.flow_shift)
        extras = {
            "size": (head.height, head.width),
            "image_latents": image_latents,
            "img_shapes": [shapes] * rows,
            "guidance": self._guidance(head, rows),
        }
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def _guidance(self, head: Any, rows: int) -> torch.Tensor | None:
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.full([1], head.guidance_scale, device=self.device, dtype=torch.float32).expand(rows)

    def _prepare_inpaint(self, batch: Sequence[Any], head: Any) -> DenoiseState:
        """QwenImageEditInpaintPipeline's start: Qwen-Image inpainting's, from the image resized to the output
        size; its clean latents are also the conditioning tokens after the noise tokens (same grid)."""
        lh, lw = self._latent_hw(head.height, head.width)
        channels = self.transformer.config.in_channels // 4
        scheduler, full = self._schedule(head.num_inference_steps, (lh // 2) * (lw // 2), head.flow_shift)
        latents, timesteps, masked = qwen_inpaint.prepare_inpaint_latents(
            self, batch, scheduler, full, channels, resize_first=True
        )
        rows = latents.shape[0]
        extras = {
            "size": (head.height, head.width),
            "image_latents": masked.image_latents,
            "img_shapes": [[(1, lh // 2, lw // 2)] * 2] * rows,
            "guidance": self._guidance(head, rows),
            inpaint.EXTRAS_KEY: masked,
        }
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        """The scheduler's step, then (masked edits) the kept region put back."""
        return inpaint.blended_step(noise_pred, timestep, latents, state)

    # -- 3. one transformer call and the guidance combine ---------------------------------------------------

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        mask = cond["prompt_mask"]
        # diffusers drops an all-ones mask (no padding), which takes the unmasked attention path.
        mask = None if bool(mask.all()) else mask
        out = self.transformer(
            hidden_states=torch.cat([latents, state.extras["image_latents"]], dim=1),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=state.extras["guidance"],
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=cond["prompt_embeds"],
            img_shapes=state.extras["img_shapes"],
            attention_kwargs={},
            return_dict=False,
        )[0]
        return out[:, : latents.shape[1]]

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: Any, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        return norm_rescaled_cfg(cond, uncond, self.guidance_rule.scale(head))

    # -- 4. decode ---------------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        height, width = state.extras["size"]
        latents = edit_module.QwenImageEditPipeline._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents.to(self.vae.dtype)
        mean, std = latents_stats(self.vae, latents)
        latents = latents / (1.0 / std) + mean  # diffusers' operations (not latents * std), for equal bits
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        images = self.image_processor.postprocess(image, output_type="pil")
        return inpaint.apply_overlays(images, state, self.image_processor)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit 2509/2511: up to `max_image_inputs` input images, each shown and encoded."""

    family = "qwen_image_edit_plus"
    multi_image = True
    diffusers_module = plus_module

    @classmethod
    def _diffusers_class_name(cls) -> str:
        return "QwenImageEditPlusPipeline"

    def prepare_inputs(self, images: list[Image.Image]) -> EditInputs:
        """EditPlus: each input at ~384² for the processor and ~1024² for the VAE (its own aspect)."""
        prompt_images, pixels, sizes = [], [], []
        for image in images:
            ratio = image.size[0] / image.size[1]
            cw, ch = plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, ratio)
            vw, vh = plus_module.calculate_dimensions(plus_module.VAE_IMAGE_SIZE, ratio)
            prompt_images.append(self.image_processor.resize(image, ch, cw))
            pixels.append(self.image_processor.preprocess(image, vh, vw).unsqueeze(2))
            sizes.append((vw, vh))
        return EditInputs(prompt_images=prompt_images, vae_pixels=pixels, vae_sizes=sizes)
