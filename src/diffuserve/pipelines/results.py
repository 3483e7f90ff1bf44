"""What a pipeline call returns: each request's outputs (`RequestOutput`) and the batch's (`BatchResult`).

Plain data the executor carries between ranks and the engine hands to the routes; `pipelines/base.py` re-exports
both for the family adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image


@dataclass
class RequestOutput:
    """The outputs of one request: `n` images, or `n` videos (each a list of frames), or `n` meshes."""

    images: list[Image.Image] = field(default_factory=list)
    videos: list[list[Image.Image]] = field(default_factory=list)
    step_cache: dict[str, Any] | None = None
    """Step-cache counts of the request's rows (method, computed_steps, reused_steps); None without a cache."""
    meshes: list[Any] = field(default_factory=list)
    """Mesh families: one `families.hunyuan3d.adapter.Mesh` (vertices, faces) per output row."""
    audios: list[Any] = field(default_factory=list)
    """Joint audio-video families: one float32 waveform tensor (channels, samples) in [-1, 1] per output video, at
    `audio_sample_rate`; empty when the family makes no sound or the request turned it off (`generate_audio`)."""
    audio_sample_rate: int | None = None
    """Samples per second of `audios` (the family's vocoder rate); None without audio."""


@dataclass
class BatchResult:
    outputs: list[RequestOutput]
    """One entry per request, in the order the batch was given."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage (encode, latents, denoise, decode) for metrics."""
