"""Native Wan text-to-video (Wan2.1, Wan2.2 A14B with two experts, Wan2.2 TI2V-5B) on the shared recipe.

The family parts follow `diffusers.WanPipeline` step for step: UMT5 embeddings trimmed to each prompt's
length and zero-padded back to `max_sequence_length`, float32 latents of (frames-1)/4+1 latent frames, the
checkpoint's scheduler (UniPC over flow sigmas), classic CFG under `guidance_scale` > 1 with the empty
negative prompt by default, and for Wan2.2 A14B the switch from `transformer` (high noise, `guidance_scale`)
to `transformer_2` (low noise, `guidance_scale_2`) at `boundary_ratio` x num_train_timesteps. TI2V-5B's
`expand_timesteps` gives every latent token its own timestep (all equal for text-to-video).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.video_processor import VideoProcessor
from PIL import Image

from diffuserve.errors import CheckpointError
from diffuserve.family_spec.checkpoint import required_components
from diffuserve.pipelines import recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.recipe import Cond, DenoiseState

MAX_SEQUENCE_LENGTH = 512
"""UMT5 tokens per prompt (diffusers' WanPipeline default)."""


class WanAdapter(AdapterBase):
    """Wan text-to-video: one or two denoising experts, classic CFG."""

    family = "wan"

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        tokenizer: Any,
        scheduler: Any,
        transformer_2: Any = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.vae, self.text_encoder, self.tokenizer, self.scheduler = vae, text_encoder, tokenizer, scheduler
        self.boundary_ratio = boundary_ratio
        """Wan2.2 A14B: steps with t >= boundary_ratio * num_train_timesteps run `transformer`, later ones
        `transformer_2`; None: one expert for every step."""
        self.expand_timesteps = expand_timesteps
        self.device, self.dtype = torch.device(device), dtype
        self.denoisers = ("transformer",) if transformer_2 is None else ("transformer", "transformer_2")
        # A two-expert Wan2.2 checkpoint takes the second expert's fields (`family_spec/wan.check_wan`).
        self.family_facts = {"two_experts": boundary_ratio is not None}
        if boundary_ratio is not None:
            self.checkpoint_fields = frozenset({"guidance_scale_2", "boundary_ratio"})
        self.described = {
            "experts": list(self.denoisers),
            "boundary_ratio": boundary_ratio,
            "expand_timesteps": expand_timesteps,
        }
        self.components = {"text_encoder": text_encoder, "vae": vae, "transformer": transformer}
        if transformer_2 is not None:
            self.components["transformer_2"] = transformer_2
        self.temporal_factor = int(vae.config.scale_factor_temporal)
        self.spatial_factor = int(vae.config.scale_factor_spatial)
        self.frame_multiple = self.temporal_factor
        # The spec's facts: the size multiple (VAE spatial factor x patch), the RoPE size limit, the defaults and
        # continuous batching (Wan2.1, Wan2.2 TI2V-5B and A14B: each request owns a fresh_scheduler copy, so UniPC
        # keeps its history per request; I2V is image-conditioned and does not step in a group).
        self.bind_facts(component_configs(self.components))
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial_factor)
        self._max_length = min(MAX_SEQUENCE_LENGTH, int(getattr(tokenizer, "model_max_length", MAX_SEQUENCE_LENGTH)))

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> WanAdapter:
        required = tuple(required_components(cls.family, components))
        if components.get("transformer_2") is not None and components.get("boundary_ratio") is None:
            raise CheckpointError(
                "a Wan checkpoint with transformer_2 needs `boundary_ratio` in model_index.json "
                "(the timestep share at which the low-noise expert takes over)."
            )
        return cls(
            **{k: components.get(k) for k in (*required, "transformer_2", "boundary_ratio")},
            expand_timesteps=bool(components.get("expand_timesteps", False)),
            device=device,
            dtype=dtype,
        )

    # -- 1. encode --------------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """UMT5 states of each text, trimmed to its tokens and zero-padded to the fixed length (as diffusers)."""
        inputs = self.tokenizer(
            [prompt_clean(t) for t in texts],
            padding="max_length",
            max_length=self._max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask
        states = self.text_encoder(inputs.input_ids.to(self.device), mask.to(self.device)).last_hidden_state
        lengths = mask.gt(0).sum(dim=1).tolist()
        rows = [
            torch.cat([s[:n], s.new_zeros(self._max_length - n, s.size(1))])
            for s, n in zip(states, lengths, strict=True)
        ]
        return {"prompt_embeds": torch.stack(rows).to(self.transformer.dtype)}

    # -- 2. latents and schedule --------------------------------------------------------------------------------

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        frames = (head.num_frames - 1) // self.temporal_factor + 1
        shape = (self.vae.config.z_dim, frames, head.height // self.spatial_factor, head.width // self.spatial_factor)
        latents = recipe.batch_noise(batch, shape, device=self.device, dtype=torch.float32)
        # A private scheduler per batch: UniPC keeps multistep history in lists it mutates in place.
        scheduler = recipe.scheduler_template(self.scheduler, head.flow_shift)
        scheduler.set_timesteps(head.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        # A job's own boundary_ratio (validated: two-expert checkpoints only) moves the expert switch.
        ratio = self.boundary_ratio if head.boundary_ratio is None else head.boundary_ratio
        boundary = None if ratio is None else ratio * scheduler.config.num_train_timesteps
        extras = {"boundary": boundary, "size": (head.height, head.width)}
        return DenoiseState(latents=latents, timesteps=scheduler.timesteps, scheduler=scheduler, extras=extras)

    def denoiser_for_step(self, step_index: int, timestep: torch.Tensor, state: DenoiseState) -> str:
        boundary = state.extras["boundary"]
        return "transformer" if boundary is None or timestep >= boundary else "transformer_2"

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: Any, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        expert = self.denoiser_for_step(step_index, state.timesteps[step_index], state)
        scale = head.guidance_scale
        if expert == "transformer_2":
            scale = head.guidance_scale if head.guidance_scale_2 is None else head.guidance_scale_2
        return recipe.combine_cfg(cond, uncond, scale)

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        model = self.transformer if model_key == "transformer" else self.transformer_2
        if self.expand_timesteps:
            # One timestep per latent token (frames x h/2 x w/2); text-to-video keeps them all equal.
            tokens = latents.shape[2] * (latents.shape[3] // 2) * (latents.shape[4] // 2)
            timestep = timestep[:, None].expand(-1, tokens)
        return model(
            hidden_states=latents.to(model.dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]

    # -- 4. decode ------------------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[list[Image.Image]]:
        """Unnormalise with the VAE's latents mean/std, decode, and round frames as the diffusers backend does."""
        cfg = self.vae.config
        latents = latents.to(self.device, self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        video = self.vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.video_processor.postprocess_video(video, output_type="np")
        return [[Image.fromarray((np.clip(f, 0, 1) * 255).round().astype("uint8")) for f in clip] for clip in frames]

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """The middle frame of each row's current decode."""
        return [clip[len(clip) // 2] for clip in self.decode(latents, state)]


class WanI2VAdapter(WanAdapter):
    """Wan image-to-video (`WanImageToVideoPipeline`): the first frame is the request's input image.

    The image conditions twice, as in diffusers: its CLIP vision tokens (penultimate hidden states) go to the
    transformer's image cross-attention, and the VAE-encoded conditioning video (the image, then zero frames)
    with a first-frame mask is concatenated to the noise on the channel axis (TI2V-style `expand_timesteps`
    checkpoints instead pin the first latent frame and give it timestep 0). Jobs with an image never merge.
    """

    family = "wan_i2v"
    min_image_inputs = 1

    def __init__(self, *, image_encoder: Any = None, image_processor: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image_encoder, self.image_processor = image_encoder, image_processor
        if image_encoder is not None:
            self.components["image_encoder"] = image_encoder
            self.conditioning_components = ("image_encoder",)

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> WanI2VAdapter:
        base = WanAdapter.from_components(components, device=device, dtype=dtype)
        if components.get("image_encoder") is None and base.transformer.config.image_dim is not None:
            raise CheckpointError(
                "this Wan I2V transformer takes image tokens (image_dim) but the checkpoint has no "
                "image_encoder/image_processor components."
            )
        return cls(
            transformer=base.transformer,
            transformer_2=base.transformer_2,
            vae=base.vae,
            text_encoder=base.text_encoder,
            tokenizer=base.tokenizer,
            scheduler=base.scheduler,
            boundary_ratio=base.boundary_ratio,
            expand_timesteps=base.expand_timesteps,
            image_encoder=components.get("image_encoder"),
            image_processor=components.get("image_processor"),
            device=device,
            dtype=dtype,
        )

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        state = super().prepare(batch, head, positive)
        rows = state.latents.shape[0]
        image = Image.open(io.BytesIO(head.image_inputs[0])).convert("RGB")
        if self.image_encoder is not None and self.transformer.config.image_dim is not None:
            pixels = self.image_processor(images=image, return_tensors="pt").to(self.device)
            embeds = self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]
            state.extras["image_embeds"] = embeds.repeat(rows, 1, 1).to(self.transformer.dtype)
        height, width = head.height, head.width
        frames = head.num_frames
        video = self.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        video = video.unsqueeze(2)
        if not self.expand_timesteps:
            video = torch.cat(
                [video, video.new_zeros(video.shape[0], video.shape[1], frames - 1, height, width)], dim=2
            )
        cfg = self.vae.config
        encoded = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode()
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(self.device, torch.float32)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(self.device, torch.float32)
        condition = ((encoded.to(torch.float32) - mean) * inv_std).repeat(rows, 1, 1, 1, 1)
        latent_frames, lh, lw = state.latents.shape[2:]
        if self.expand_timesteps:
            mask = torch.ones(1, 1, latent_frames, lh, lw, dtype=torch.float32, device=self.device)
            mask[:, :, 0] = 0
            state.extras.update(condition=condition, first_frame_mask=mask)
            return state
        mask = torch.ones(rows, 1, frames, lh, lw)
        mask[:, :, 1:] = 0
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=self.temporal_factor)
        mask = torch.concat([first, mask[:, :, 1:]], dim=2)
        mask = mask.view(rows, -1, self.temporal_factor, lh, lw).transpose(1, 2).to(self.device)
        state.extras["condition"] = torch.concat([mask, condition], dim=1)
        return state

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        model = self.transformer if model_key == "transformer" else self.transformer_2
        condition = state.extras["condition"]
        if self.expand_timesteps:
            mask = state.extras["first_frame_mask"]
            hidden = (1 - mask) * condition + mask * latents
            timestep = (mask[0][0][:, ::2, ::2] * timestep[0]).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        else:
            hidden = torch.cat([latents, condition], dim=1)
        return model(
            hidden_states=hidden.to(model.dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_image=state.extras.get("image_embeds"),
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[list[Image.Image]]:
        if self.expand_timesteps:
            mask = state.extras["first_frame_mask"]
            latents = (1 - mask) * state.extras["condition"] + mask * latents
        return super().decode(latents, state)
