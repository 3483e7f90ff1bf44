"""LTX-2's joint latents as ONE tensor for the shared recipe, and its guidance.

The recipe denoises one latents tensor whose first axis is the rows. LTX-2 denoises two sequences at once: the
packed video tokens (rows, video tokens, video channels) and the packed audio tokens (rows, audio tokens, audio
channels), both stepped by the same flow-matching Euler step over the same sigmas (diffusers keeps a deep copy
of the scheduler for the audio, with the same timesteps). The Euler step is elementwise, so stepping the two
flattened and concatenated on axis 1 is exactly stepping each: `JointLayout` cuts that tensor back into the two.

The guidance is diffusers' `LTX2Pipeline` rule, in x0 space per modality: the conditional x0 plus
(cfg - 1) x (cond - uncond), stg x (cond - perturbed) and (modality - 1) x (cond - isolated), then the
guidance rescale against the conditional x0, then back to a velocity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock

STG_SCALE = 1.0
"""diffusers' `stg_scale` / `audio_stg_scale` default: spatio-temporal guidance against a pass whose self-attention
in `STG_BLOCKS` is perturbed (skipped)."""
STG_BLOCKS = (28,)
"""diffusers' `spatio_temporal_guidance_blocks` default. A checkpoint with fewer blocks perturbs nothing there: the
perturbed pass equals the conditional one, its term is zero and the pass is not run."""
MODALITY_SCALE = 3.0
"""diffusers' `modality_scale` / `audio_modality_scale` default: guidance against a pass whose audio and video do
not attend to each other (`isolate_modalities`)."""
GUIDANCE_RESCALE = 0.7
"""diffusers' `guidance_rescale` / `audio_guidance_rescale` default."""


@dataclass(frozen=True)
class JointLayout:
    """Where the video and the audio tokens sit in a row of the recipe's flat latents."""

    video_tokens: int
    video_channels: int
    audio_tokens: int
    audio_channels: int

    @property
    def video_size(self) -> int:
        return self.video_tokens * self.video_channels

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, video_size + audio_size) -> video (rows, Nv, Cv), audio (rows, Na, Ca)."""
        rows = flat.shape[0]
        video = flat[:, : self.video_size].reshape(rows, self.video_tokens, self.video_channels)
        audio = flat[:, self.video_size :].reshape(rows, self.audio_tokens, self.audio_channels)
        return video, audio

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


@dataclass(frozen=True)
class Guidance:
    """The guidance scales of one batch (the video's CFG is the request's; the rest are diffusers' defaults)."""

    video_cfg: float
    audio_cfg: float
    stg: float
    modality: float
    rescale: float
    audio: bool
    """Whether the audio tokens are generated (False: they are one placeholder token nothing attends to)."""


def rescale(guided: torch.Tensor, cond: torch.Tensor, factor: float) -> torch.Tensor:
    """diffusers' `rescale_noise_cfg`, per row: the guided prediction's std brought toward the conditional one."""
    if factor <= 0:
        return guided
    dims = list(range(1, cond.ndim))
    rescaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * rescaled + (1 - factor) * guided


def guide_modality(
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond: torch.Tensor,
    terms: list[tuple[float, torch.Tensor]],
    factor: float,
) -> torch.Tensor:
    """One modality's guided velocity: `terms` are (weight, other velocity), each adding weight x (cond - other)
    in x0 space (x0 = x - v * sigma), then the rescale, then back to a velocity."""
    x0 = x - cond * sigma
    guided = x0
    for weight, other in terms:
        guided = guided + weight * (x0 - (x - other * sigma))
    guided = rescale(guided, x0, factor)
    return (x - guided) / sigma


@dataclass
class JointBlockMetadata(TransformerBlockMetadata):
    """Where LTX-2's block keeps its two streams, for the step caches (`step_cache/hooks.py`): it returns
    (video, audio); the audio enters as `audio_hidden_states` (not the text's `encoder_hidden_states`), and its
    RoPE (cos, sin) pairs carry one entry per row."""

    second_stream: str = "audio_hidden_states"
    row_arguments: tuple[str, ...] = (
        "video_rotary_emb",
        "audio_rotary_emb",
        "ca_video_rotary_emb",
        "ca_audio_rotary_emb",
    )


# diffusers registers no metadata for LTX-2's block (its own caches do not cover it): the step caches read ours.
TransformerBlockRegistry.register(
    LTX2VideoTransformerBlock, JointBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1)
)
