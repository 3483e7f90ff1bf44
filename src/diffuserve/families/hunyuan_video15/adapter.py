"""Native HunyuanVideo 1.5 text-to-video and image-to-video on the shared recipe.

The family parts follow `diffusers.HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline` step for step,
through the pipelines' own static encoders: Qwen2.5-VL states (the chat template, the layer before the last two,
the system prompt's 108 tokens cropped) and ByT5 states of the prompt's quoted glyph texts (zeros when it quotes
none); latents of (frames-1)/t+1 latent frames in the DiT's dtype; the model input is the latents, the condition
latents (zeros, or the VAE-encoded first frame) and the first-frame mask on the channel axis; FlowMatchEuler over
`linspace(1, 0, steps + 1)[:-1]`; classic CFG (the guider's combination) whenever `guidance_scale` != 1, the empty
negative prompt by default.

Two differences in how the tensors are laid out, both invisible in the frames (masked tokens get zero attention
weight): each text sequence is cut to the batch's longest valid text (diffusers pads Qwen to 1000 and ByT5 to 256
tokens), and text-to-video passes one zero image token instead of 729 (the DiT masks them all out when every image
embedding is zero).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline
from PIL import Image

from diffuserve.family_spec.checkpoint import required_components
from diffuserve.pipelines import recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.recipe import Cond, DenoiseState

# diffusers 0.42.1 registers HunyuanVideo's blocks but not 1.5's: say where its (hidden, encoder hidden) outputs sit,
# so the step caches (step_cache/hooks.py) and diffusers' own cache hooks can cut at its blocks.
TransformerBlockRegistry.register(
    model_class=HunyuanVideo15TransformerBlock,
    metadata=TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1),
)


class TextFirstAttnProcessor:
    """`HunyuanVideo15AttnProcessor2_0` with the joint sequence laid out as `[text, video]` and a key-padding mask.

    diffusers' processor attends over `[video, text]` with a (batch, 1, S, S) mask that also blanks the padded text
    queries. Here the same keys are masked for every query, so each video token (and each real text token) sees
    exactly what it sees there; only padded text tokens, which no one attends to and the output drops, differ. The
    layout is the one the sequence split (`parallel/sequence.py`: text replicated, video tokens sharded) and its
    key-padding mask read, so one process and a sequence-parallel group run the same processor. Attention goes
    through the diffusers module's `dispatch_attention_fn`, looked up per call, where the split hooks in.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers import transformer_hunyuan_video15 as module

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query, key, value = (
            heads(attn.to_q(hidden_states)),
            heads(attn.to_k(hidden_states)),
            heads(attn.to_v(hidden_states)),
        )
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query = heads(attn.add_q_proj(encoder_hidden_states))
        text_key = heads(attn.add_k_proj(encoder_hidden_states))
        text_value = heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        text = encoder_hidden_states.shape[1]
        keep = attention_mask.bool()
        keep = torch.cat([keep, keep.new_ones(keep.shape[0], query.shape[1])], dim=1)[:, None, None]
        out = module.dispatch_attention_fn(
            torch.cat([text_query, query], dim=1),
            torch.cat([text_key, key], dim=1),
            torch.cat([text_value, value], dim=1),
            attn_mask=keep,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        video = attn.to_out[1](attn.to_out[0](out[:, text:]))
        return video, attn.to_add_out(out[:, :text])


class HunyuanVideo15Adapter(AdapterBase):
    """HunyuanVideo 1.5 text-to-video: one DiT, classic CFG, rows merge and join running groups."""

    family = "hunyuan_video_15"
    meanflow_timestep = False
    """Pass `timestep_r` to a `use_meanflow` DiT: diffusers' I2V pipeline does, its T2V pipeline does not."""
    masked_sequences = {"prompt_embeds": "prompt_mask", "prompt_embeds_2": "prompt_mask_2"}

    def __init__(
        self,
        *,
        components: dict[str, Any],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.transformer, self.vae, self.scheduler = (components[k] for k in ("transformer", "vae", "scheduler"))
        self.text_encoder, self.tokenizer = components["text_encoder"], components["tokenizer"]
        self.text_encoder_2, self.tokenizer_2 = components["text_encoder_2"], components["tokenizer_2"]
        self.guider = components.get("guider")
        self.device, self.dtype = torch.device(device), dtype
        self.components = {
            "text_encoder": self.text_encoder,
            "text_encoder_2": self.text_encoder_2,
            "vae": self.vae,
            "transformer": self.transformer,
        }
        for block in self.transformer.transformer_blocks:  # [text, video] with a key-padding mask (see the class)
            block.attn.set_processor(TextFirstAttnProcessor())
        self.temporal_factor = int(self.vae.config.temporal_compression_ratio)
        self.spatial_factor = int(self.vae.config.spatial_compression_ratio)
        self.frame_multiple = self.temporal_factor
        configs = component_configs(self.components)
        if self.guider is not None:
            configs["guider"] = dict(self.guider.config)
        # The spec's facts: size multiple, defaults (guidance from the saved guider), continuous batching, text
        # encoders. Continuous: FlowMatchEuler keeps no history and every request owns its scheduler copy.
        self.bind_facts(configs)
        self.video_processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.spatial_factor)
        # The pipeline's fixed text settings (system prompt, template crop), read from the class itself.
        self._system_message, self._crop = _pipeline_text_settings()

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> HunyuanVideo15Adapter:
        required_components(cls.family, components)  # the guider is optional: it only names the default scale
        return cls(components=components, device=device, dtype=dtype)

    # -- 1. encode --------------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """Qwen2.5-VL (`text_encoder`) or ByT5 glyph (`text_encoder_2`) states of each text, with their masks, by
        the diffusers pipeline's own static encoders."""
        if key == "text_encoder":
            embeds, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
                text_encoder=self.text_encoder,
                tokenizer=self.tokenizer,
                prompt=texts,
                device=self.device,
                tokenizer_max_length=_MLLM_LENGTH,
                system_message=self._system_message,
                crop_start=self._crop,
            )
            return {"prompt_embeds": embeds.to(self.transformer.dtype), "prompt_mask": mask.long()}
        embeds, mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            tokenizer=self.tokenizer_2,
            text_encoder=self.text_encoder_2,
            prompt=texts,
            device=self.device,
            tokenizer_max_length=_BYT5_LENGTH,
        )
        return {"prompt_embeds_2": embeds.to(self.transformer.dtype), "prompt_mask_2": mask.long()}

    # -- 2. latents and schedule ------------------------------------------------------------------------------

    def latent_shape(self, head: Any) -> tuple[int, int, int, int]:
        frames = (head.num_frames - 1) // self.temporal_factor + 1
        lh, lw = head.height // self.spatial_factor, head.width // self.spatial_factor
        return (int(self.vae.config.latent_channels), frames, lh, lw)

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        latents = recipe.batch_noise(batch, self.latent_shape(head), device=self.device, dtype=self.transformer.dtype)
        scheduler = recipe.scheduler_template(self.scheduler, head.flow_shift)
        sigmas = np.linspace(1.0, 0.0, head.num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        scheduler.set_begin_index(0)
        return DenoiseState(latents=latents, timesteps=scheduler.timesteps, scheduler=scheduler, extras={})

    def condition(self, latents: torch.Tensor, state: DenoiseState) -> tuple[torch.Tensor, torch.Tensor]:
        """(condition latents + first-frame mask on the channel axis, image embeddings) of `latents`' rows.

        Text-to-video: zero latents and mask (as diffusers), and one zero image token (see the module doc)."""
        rows, channels, frames, lh, lw = latents.shape
        zeros = latents.new_zeros(rows, channels + 1, frames, lh, lw)
        image = latents.new_zeros(rows, 1, int(self.transformer.config.image_embed_dim))
        return zeros, image

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        condition, image_embeds = self.condition(latents, state)
        model = self.transformer
        timestep_r = None
        if self.meanflow_timestep and model.config.use_meanflow:  # the next timestep (0 after the last)
            index = int((state.timesteps == timestep[0]).nonzero()[0])
            following = (
                state.timesteps[index + 1] if index + 1 < len(state.timesteps) else state.timesteps.new_zeros(())
            )
            timestep_r = following.expand(latents.shape[0]).to(latents.dtype)
        return model(
            hidden_states=torch.cat([latents, condition], dim=1).to(model.dtype),
            image_embeds=image_embeds.to(model.dtype),
            timestep=timestep.to(latents.dtype),
            timestep_r=timestep_r,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_attention_mask=cond["prompt_mask"],
            encoder_hidden_states_2=cond["prompt_embeds_2"],
            encoder_attention_mask_2=cond["prompt_mask_2"],
            return_dict=False,
        )[0]

    # -- 4. decode --------------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[list[Image.Image]]:
        """Unscale and decode, ONE ROW AT A TIME: diffusers 0.42.1's AutoencoderKLHunyuanVideo15 mid-block attention
        builds a (batch, S, S) causal mask against (batch, 1, S, C) queries, so a batch of two fails ("output with
        shape [2, 1, S, S] doesn't match the broadcast shape [2, 2, S, S]"). Each row decodes alone, exactly as its
        singleton run does; then frames are rounded as the diffusers backend rounds them."""
        latents = latents.to(self.device, self.vae.dtype) / self.vae.config.scaling_factor
        video = torch.cat([self.vae.decode(row[None], return_dict=False)[0] for row in latents])
        frames = self.video_processor.postprocess_video(video, output_type="np")
        return [[Image.fromarray((np.clip(f, 0, 1) * 255).round().astype("uint8")) for f in clip] for clip in frames]

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """The middle frame of each row's current decode."""
        return [clip[len(clip) // 2] for clip in self.decode(latents, state)]


_MLLM_LENGTH, _BYT5_LENGTH = 1000, 256
"""`HunyuanVideo15Pipeline.tokenizer_max_length` / `tokenizer_2_max_length` (set in its __init__, not on the class)."""


def _pipeline_text_settings() -> tuple[str, int]:
    """The system message and template crop `HunyuanVideo15Pipeline._get_mllm_prompt_embeds` defaults to."""
    import inspect

    parameters = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    return parameters["system_message"].default, int(parameters["crop_start"].default)


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    """HunyuanVideo 1.5 image-to-video (`HunyuanVideo15ImageToVideoPipeline`): each row's first frame is its own
    request's input image.

    The image conditions twice, as in diffusers: its SigLIP tokens (last hidden states) join the DiT's text tokens,
    and its VAE latents (first latent frame; later frames zero) with a first-frame mask are concatenated to the noise
    on the channel axis. The image is resized and centre-cropped to the request's size (diffusers picks the bucket of
    `target_size` nearest the image's aspect; the two agree when the request asks for that bucket)."""

    family = "hunyuan_video_15_i2v"
    min_image_inputs = 1
    meanflow_timestep = True

    def __init__(self, *, components: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(components=components, **kwargs)
        self.image_encoder, self.feature_extractor = components["image_encoder"], components["feature_extractor"]
        self.components["image_encoder"] = self.image_encoder
        self.conditioning_components = ("image_encoder",)
        self.image_processor = HunyuanVideo15ImageProcessor(
            vae_scale_factor=self.spatial_factor, do_resize=False, do_convert_rgb=True
        )

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> HunyuanVideo15I2VAdapter:
        required_components(cls.family, components)  # with SigLIP's image_encoder and feature_extractor
        base = HunyuanVideo15Adapter.from_components(components, device=device, dtype=dtype)
        return cls(components=components, device=base.device, dtype=base.dtype)

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        state = super().prepare(batch, head, positive)
        dtype = self.transformer.dtype
        _, frames, lh, lw = self.latent_shape(head)
        conditions, embeds = [], []
        for params in batch:  # each request's own image, repeated over its n rows
            image = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB")
            image = self.image_processor.resize(image, height=head.height, width=head.width, resize_mode="crop")
            pixels = self.feature_extractor.preprocess(
                images=image, do_resize=True, return_tensors="pt", do_convert_rgb=True
            ).to(self.device, self.image_encoder.dtype)
            tokens = self.image_encoder(**pixels).last_hidden_state.to(dtype)
            video = self.image_processor.preprocess(image, height=head.height, width=head.width)
            encoded = self.vae.encode(video.to(self.device, self.vae.dtype).unsqueeze(2)).latent_dist.mode()
            first = (encoded * self.vae.config.scaling_factor).to(dtype)
            condition = first.new_zeros(1, first.shape[1] + 1, frames, lh, lw)
            condition[:, : first.shape[1], :1] = first
            condition[:, -1, 0] = 1.0  # the first-frame mask
            conditions.append(condition.expand(params.n, -1, -1, -1, -1))
            embeds.append(tokens.expand(params.n, -1, -1))
        state.extras.update(condition=torch.cat(conditions), image_embeds=torch.cat(embeds))
        return state

    def condition(self, latents: torch.Tensor, state: DenoiseState) -> tuple[torch.Tensor, torch.Tensor]:
        return state.extras["condition"], state.extras["image_embeds"]
