"""Native LTX-2 / LTX-2.3 (joint audio-video) on the shared recipe, text-to-video and image-to-video.

The family parts follow `diffusers.LTX2Pipeline` (and `LTX2ImageToVideoPipeline` for a request with an input
image) step for step: Gemma3's every hidden state, left-padded to `max_sequence_length` 1024, through the text
connectors (one video and one audio text stream); per row, the video noise then the audio noise from the row's
generator; the flow-matching Euler schedule over `linspace(1, 1/n, n)` sigmas; each step one joint transformer
call per guidance branch (CFG, STG where the checkpoint has the perturbed block, modality isolation) combined in
x0 space with the guidance rescale (`layout.py`); the video VAE decode and the audio VAE + vocoder decode.

`generate_audio=False` skips the audio branch: the audio sequence is one placeholder token (diffusers' audio RoPE
cannot take zero), every pass isolates the modalities so the video never reads it, and the audio VAE and the
vocoder never run. That video is NOT the with-audio video (in the joint model the video attends to the audio);
it equals diffusers' pipeline with its transformer's `isolate_modalities` forced on, which the tests check.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import retrieve_timesteps
from diffusers.pipelines.ltx2.utils import (
    apply_image_conditioning_crf,
    resolve_default_image_crf,
)
from diffusers.pipelines.ltx2.utils import conditioning_frame_rate as conditioning_fps
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor
from PIL import Image

from diffuserve.families.ltx2 import layout
from diffuserve.families.ltx2.layout import Guidance, JointLayout
from diffuserve.pipelines import recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.recipe import Cond, DenoiseState

MAX_SEQUENCE_LENGTH = 1024
"""Gemma3 tokens per prompt (diffusers' LTX2Pipeline default), left-padded."""


class LTX2Adapter(AdapterBase):
    """LTX-2 joint audio-video: one transformer call per guidance branch denoises the video and audio tokens."""

    family = "ltx2"
    masked_sequences = {"video_embeds": "text_mask", "audio_embeds": "text_mask"}

    def __init__(self, *, device: torch.device | str, dtype: torch.dtype, **parts: Any) -> None:
        """`parts`: the spec's `required_components` by model_index.json key (`AdapterBase.from_components`)."""
        super().__init__()
        self.bind_parts(parts, device=device, dtype=dtype)
        self.transformer: Any
        self.vae: Any
        self.audio_vae: Any
        self.vocoder: Any
        self.temporal_factor = int(self.vae.temporal_compression_ratio)
        self.spatial_factor = int(self.vae.spatial_compression_ratio)
        self.frame_multiple = self.temporal_factor
        self.bind_facts(component_configs(self.components))
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial_factor)
        # The vocoder's waveform rate (`RequestOutput.audio_sample_rate`; the published vocoder writes 24 kHz from the
        # audio VAE's 16 kHz mel frames).
        self.audio_sample_rate = int(self.vocoder.config.output_sampling_rate)
        self.described = {"audio_sample_rate": self.audio_sample_rate}
        self.tokenizer.padding_side = "left"  # Gemma reads chat-style prompts left-padded (diffusers sets it too)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    # -- 1. encode --------------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """Gemma3's stacked hidden states through the text connectors: the video and audio text streams and their
        mask, one row per text (fixed length: the padding is on the left, as diffusers pads)."""
        inputs = self.tokenizer(
            [t.strip() for t in texts],
            padding="max_length",
            max_length=MAX_SEQUENCE_LENGTH,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(self.device)
        out = self.text_encoder(
            input_ids=inputs.input_ids.to(self.device), attention_mask=mask, output_hidden_states=True
        )
        embeds = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(self.text_encoder.dtype)
        with self.recipe.component_scope("connectors"):
            video, audio, connector_mask = self.connectors(embeds, mask, padding_side="left")
        # The transformer reads the text only through cross-attention, without positions, and masks the padding
        # (a -10000 bias: exp underflows to exactly 0). So each row's valid tokens move to the front and the
        # padding every row has is cut (the recipe's `masked_sequences` then trims and pads per batch): the same
        # attention over far fewer keys. Connectors with learnable registers fill the padding and leave nothing
        # masked, so nothing is cut there.
        order = torch.argsort(1 - connector_mask.to(torch.int8), dim=1, stable=True)
        length = max(int(connector_mask.sum(dim=1).max()), 1)
        order = order[:, :length]

        def front(x: torch.Tensor) -> torch.Tensor:
            return x.gather(1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1]) if x.ndim == 3 else order)

        return {"video_embeds": front(video), "audio_embeds": front(audio), "text_mask": front(connector_mask)}

    def guidance(self, head: Any) -> Guidance:
        audio = head.generate_audio is not False
        return Guidance(
            video_cfg=head.guidance_scale,
            audio_cfg=self.guidance_rule.audio_scale or 1.0,
            stg=layout.STG_SCALE if self._has_stg_block() else 0.0,
            modality=layout.MODALITY_SCALE if audio else 1.0,  # isolated already: the term is zero
            rescale=layout.GUIDANCE_RESCALE,
            audio=audio,
        )

    def _has_stg_block(self) -> bool:
        return any(block < len(self.transformer.transformer_blocks) for block in layout.STG_BLOCKS)

    # -- 2. latents and schedule --------------------------------------------------------------------------------

    def audio_frames(self, head: Any) -> int:
        """diffusers: the audio latents of the clip's duration (num_frames / fps seconds); one placeholder token
        without audio."""
        if head.generate_audio is False:
            return 1
        cfg = self.audio_vae.config
        per_second = cfg.sample_rate / cfg.mel_hop_length / float(self.audio_vae.temporal_compression_ratio)
        return round(head.num_frames / float(head.fps) * per_second)

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        frames = (head.num_frames - 1) // self.temporal_factor + 1
        grid = (frames, head.height // self.spatial_factor, head.width // self.spatial_factor)
        channels = int(self.transformer.config.in_channels)
        audio_frames = self.audio_frames(head)
        mel = int(self.audio_vae.config.mel_bins) // int(self.audio_vae.mel_compression_ratio)
        audio_channels = int(self.audio_vae.config.latent_channels)
        videos, audios = [], []
        for generator in recipe.row_generators(batch):  # per row: the video noise, then the audio noise
            videos.append(randn_tensor((1, channels, *grid), generator=generator, device=self.device))
            audios.append(randn_tensor((1, audio_channels, audio_frames, mel), generator=generator, device=self.device))
        video = torch.cat(videos)
        extras: dict[str, Any] = {"grid": grid, "fps": float(head.fps), "audio_frames": audio_frames, "mel": mel}
        if any(p.image_inputs for p in batch):
            # Image-to-video rows (an input image is per row: text-only rows may share the batch, unpinned).
            with self.recipe.component_scope("vae"):
                condition = self._image_latents(batch, head, grid)
            pinned = torch.tensor([bool(p.image_inputs) for p in batch for _ in range(p.n)], device=self.device)
            mask = torch.zeros(video.shape[0], 1, *grid, device=self.device)
            mask[:, :, 0] = pinned.view(-1, 1, 1, 1).float()
            video = condition * mask + video * (1 - mask)
            extras["condition_mask"] = self._pack(mask).squeeze(-1)
        packed_video = self._pack(video)
        packed_audio = torch.cat(audios).transpose(1, 2).flatten(2, 3)  # (rows, L, C x mel)
        extras["layout"] = JointLayout(*packed_video.shape[1:], *packed_audio.shape[1:])
        extras["guidance"] = self.guidance(head)
        extras["video_coords"] = self.transformer.rope.prepare_video_coords(
            1, *grid, self.device, fps=conditioning_fps(float(head.fps), 1.0)
        )
        extras["audio_coords"] = self.transformer.audio_rope.prepare_audio_coords(1, audio_frames, self.device)
        scheduler = recipe.scheduler_template(self.scheduler, head.flow_shift)
        steps = head.num_inference_steps
        config = scheduler.config
        mu = _calculate_shift(packed_video.shape[1], config)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, None, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        latents = JointLayout.join(packed_video, packed_audio)
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def _pack(self, video: torch.Tensor) -> torch.Tensor:
        from diffusers import LTX2Pipeline

        cfg = self.transformer.config
        return LTX2Pipeline._pack_latents(video, cfg.patch_size, cfg.patch_size_t)

    def _image_latents(self, batch: Sequence[Any], head: Any, grid: tuple[int, int, int]) -> torch.Tensor:
        """Each row's input image, H.264 re-compressed at the checkpoint's CRF as diffusers does, VAE-encoded
        (the distribution's mode), normalised and repeated over the latent frames: (rows, C, F, H, W)."""
        crf = resolve_default_image_crf(self.text_encoder)
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1).to(self.device, torch.float32)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1).to(self.device, torch.float32)
        rows = []
        for params in batch:
            if not params.image_inputs:
                rows.extend([torch.zeros(1, self.vae.config.latent_channels, *grid, device=self.device)] * params.n)
                continue
            image = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB")
            if crf != 0:
                image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
            pixels = self.video_processor.preprocess(image, height=head.height, width=head.width)
            pixels = pixels.to(self.device, self.text_encoder.dtype).unsqueeze(2)
            encoded = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.mode().to(torch.float32)
            normalised = (encoded - mean) / std  # diffusers normalises the image latents with scaling factor 1
            rows.extend([normalised.repeat(1, 1, grid[0], 1, 1)] * params.n)
        return torch.cat(rows)

    # -- 3. denoise -------------------------------------------------------------------------------------------

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        return self._call(latents, timestep, cond, state)

    def _call(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Cond,
        state: DenoiseState,
        *,
        isolate: bool = False,
        stg_blocks: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One joint transformer call on the flat latents: the flat velocity of the video and audio tokens."""
        extras = state.extras
        shape: JointLayout = extras["layout"]
        video, audio = shape.split(latents)
        dtype = self.transformer.dtype
        video_timestep = timestep
        if "condition_mask" in extras:  # image-to-video: the pinned first frame is clean (timestep 0)
            video_timestep = timestep.unsqueeze(-1) * (1 - extras["condition_mask"])
        grid = extras["grid"]
        video_pred, audio_pred = self.transformer(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond["video_embeds"],
            audio_encoder_hidden_states=cond["audio_embeds"],
            timestep=video_timestep,
            audio_timestep=timestep,
            sigma=timestep,  # diffusers passes the raw timestep as LTX-2.3's sigma
            encoder_attention_mask=cond["text_mask"],
            audio_encoder_attention_mask=cond["text_mask"],
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            fps=extras["fps"],
            audio_num_frames=extras["audio_frames"],
            video_coords=_rows(extras["video_coords"], video.shape[0]),
            audio_coords=_rows(extras["audio_coords"], video.shape[0]),
            isolate_modalities=isolate or not extras["guidance"].audio,
            spatio_temporal_guidance_blocks=list(stg_blocks) if stg_blocks else None,
            use_cross_timestep=True,
            return_dict=False,
        )
        return JointLayout.join(video_pred.float(), audio_pred.float())

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: Any, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        # Both branches go on to `extra_guidance`, which adds the other passes and combines in x0 space.
        return torch.stack([cond, uncond])

    def extra_guidance(
        self,
        prediction: torch.Tensor,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        positive: Cond,
        negative: Cond | None,
        state: DenoiseState,
        step_index: int,
    ) -> torch.Tensor:
        """After the recipe's branches (the conditional one, and the negative one under CFG: its CFG parallel and
        step caches apply; `combine_guidance` hands both on), the STG and modality-isolation passes on the
        conditional text, combined per modality in x0 space as diffusers does."""
        cond, uncond = (prediction[0], prediction[1]) if negative is not None else (prediction, None)
        guidance: Guidance = state.extras["guidance"]
        # (video weight, audio weight, the other pass's flat velocity)
        terms: list[tuple[float, float, torch.Tensor]] = []
        if uncond is not None:
            terms.append((guidance.video_cfg - 1.0, guidance.audio_cfg - 1.0, uncond))
        if guidance.stg > 0:
            perturbed = self._call(latents, timestep, positive, state, stg_blocks=layout.STG_BLOCKS)
            terms.append((guidance.stg, guidance.stg, perturbed))
        if guidance.modality > 1.0:
            isolated = self._call(latents, timestep, positive, state, isolate=True)
            terms.append((guidance.modality - 1.0, guidance.modality - 1.0, isolated))
        shape: JointLayout = state.extras["layout"]
        # A continuous step's rows are at their own steps: each row's sigma (`step_extras`), else the batch's.
        sigma = state.extras.get("row_sigmas")
        sigma = state.scheduler.sigmas[step_index] if sigma is None else sigma.view(-1, 1, 1)
        x_video, x_audio = shape.split(latents.float())
        c_video, c_audio = shape.split(cond)
        split = [(wv, wa, shape.split(other)) for wv, wa, other in terms]
        video = layout.guide_modality(x_video, sigma, c_video, [(wv, o[0]) for wv, _, o in split], guidance.rescale)
        audio = layout.guide_modality(x_audio, sigma, c_audio, [(wa, o[1]) for _, wa, o in split], guidance.rescale)
        return JointLayout.join(video, audio)

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        stepped = state.scheduler.step(noise_pred, timestep, latents, return_dict=False)[0]
        mask = state.extras.get("condition_mask")
        if mask is None:
            return stepped
        # Image-to-video: diffusers steps frames 1.. only; the Euler step is elementwise, so keeping the pinned
        # first frame's tokens from before the step is the same.
        shape: JointLayout = state.extras["layout"]
        video, audio = shape.split(stepped)
        before, _ = shape.split(latents)
        keep = mask.unsqueeze(-1).to(video.dtype)
        return JointLayout.join(before.to(video.dtype) * keep + video * (1 - keep), audio)

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        """A continuous step's extras: the first request's (the group key holds size, frames, fps, guidance and
        generate_audio, so the layout, positions and guidance are equal), plus each row's sigma at its own step
        (its private scheduler's next step) for the x0-space guidance."""
        sigmas = [
            state.scheduler.sigmas[state.scheduler.step_index or 0].expand(state.latents.shape[0]) for state in states
        ]
        return {**states[0].extras, "row_sigmas": torch.cat(sigmas)}

    # -- 4. decode ------------------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[list[Image.Image]]:
        """The video VAE decode (frames rounded as the diffusers backend does); with audio, the audio VAE and the
        vocoder too, whose waveforms `decode_batch` hands out."""
        extras = state.extras
        shape: JointLayout = extras["layout"]
        video, audio = shape.split(latents)
        frames = self._decode_video(video, extras["grid"])
        if extras["guidance"].audio:
            extras["audios"] = self._decode_audio(audio, extras)
        return frames

    def _decode_video(self, video: torch.Tensor, grid: tuple[int, int, int]) -> list[list[Image.Image]]:
        from diffusers import LTX2Pipeline

        cfg = self.transformer.config
        video = LTX2Pipeline._unpack_latents(video, *grid, cfg.patch_size, cfg.patch_size_t)
        video = video.to(self.text_encoder.dtype)
        timestep = None
        if self.vae.config.timestep_conditioning:
            # diffusers' decode_timestep 0 with decode_noise_scale = decode_timestep: the noise is weighted 0.
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        video = LTX2Pipeline._denormalize_latents(
            video, self.vae.latents_mean, self.vae.latents_std, self.vae.config.scaling_factor
        )
        decoded = self.vae.decode(video.to(self.vae.dtype), timestep, return_dict=False)[0]
        frames = self.video_processor.postprocess_video(decoded, output_type="np")
        return [[Image.fromarray((np.clip(f, 0, 1) * 255).round().astype("uint8")) for f in clip] for clip in frames]

    def _decode_audio(self, audio: torch.Tensor, extras: dict[str, Any]) -> list[torch.Tensor]:
        """The audio VAE's mel spectrogram through the vocoder: one float32 (channels, samples) waveform per row."""
        from diffusers import LTX2Pipeline

        with self.recipe.component_scope("audio_vae"):
            audio = LTX2Pipeline._denormalize_audio_latents(
                audio, self.audio_vae.latents_mean, self.audio_vae.latents_std
            )
            audio = LTX2Pipeline._unpack_audio_latents(audio, extras["audio_frames"], num_mel_bins=extras["mel"])
            mel = self.audio_vae.decode(audio.to(self.audio_vae.dtype), return_dict=False)[0]
        with self.recipe.component_scope("vocoder"):
            waveform = self.vocoder(mel)
        return [w.float().cpu() for w in waveform]

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """The middle frame of each row's current video decode (the audio is not decoded for previews)."""
        video, _ = state.extras["layout"].split(latents)
        return [clip[len(clip) // 2] for clip in self._decode_video(video, state.extras["grid"])]


def _rows(coords: torch.Tensor, rows: int) -> torch.Tensor:
    """Position ids of one row (every row of a call shares its fps and size) for `rows` rows: diffusers' split
    RoPE reshapes by the ids' batch, so they cannot broadcast."""
    return coords.expand(rows, *coords.shape[1:])


def _calculate_shift(tokens: int, config: Any) -> float:
    """diffusers' LTX2Pipeline `calculate_shift` with its own fallbacks (0.95 / 2.05) where the config has none."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    return calculate_shift(
        tokens,
        config.get("base_image_seq_len", 1024),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.95),
        config.get("max_shift", 2.05),
    )
