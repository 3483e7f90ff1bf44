"""What the diffusers backend makes of an unmodified pipeline call's result: per-request `RequestOutput`s of PIL
frames or images, and, for joint audio-video pipelines (LTX2Pipeline returns `audio` beside `frames`), one waveform
per video at the vocoder's sample rate."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from diffuserve.pipelines.batch_rows import rows_per_request
from diffuserve.pipelines.results import RequestOutput

logger = logging.getLogger(__name__)


def to_pil(item: Any) -> Image.Image:
    """A frame or image of a diffusers result (PIL, or a float array in [0, 1], or uint8) as a PIL image."""
    if isinstance(item, Image.Image):
        return item
    array = np.asarray(item)
    if array.dtype != np.uint8:
        array = (np.clip(array, 0, 1) * 255).round().astype("uint8")
    return Image.fromarray(array)


def sample_rate(pipe: Any) -> int | None:
    """The rate of the waveform a joint audio-video pipeline returns: its vocoder's output rate (LTX-2: 24 kHz), else
    its audio VAE's; None when it has neither."""
    for part, key in (("vocoder", "output_sampling_rate"), ("audio_vae", "sample_rate")):
        value = getattr(getattr(getattr(pipe, part, None), "config", None), key, None)
        if value:
            return int(value)
    return None


def video_outputs(pipe: Any, result: Any, batch: Sequence[Any], produces_audio: bool) -> list[RequestOutput]:
    """One `RequestOutput` per request of `batch` from a video pipeline's `result`: its rows' frames and, where the
    family makes sound and the batch asked for it (`generate_audio` is a signature field, so every row agrees), its
    rows' waveforms as float32 (channels, samples) tensors."""
    items = getattr(result, "frames", None)
    if items is None:
        items = result[0]
    videos = rows_per_request([[to_pil(frame) for frame in video] for video in items], batch)
    audio = getattr(result, "audio", None) if produces_audio else None
    if audio is None or batch[0].generate_audio is False:
        # LTX2Pipeline cannot leave its audio branch out (the transformer denoises audio and video tokens together,
        # and its call has no switch for the audio decode): a silent request's waveform is computed and dropped.
        return [RequestOutput(videos=rows) for rows in videos]
    import torch

    rate = sample_rate(pipe)
    # RequestOutput's contract: float32 in [-1, 1] on the host (the vocoder's output can overshoot slightly).
    waveforms = rows_per_request([torch.as_tensor(row).detach().float().clamp(-1, 1).cpu() for row in audio], batch)
    return [
        RequestOutput(videos=rows, audios=sounds, audio_sample_rate=rate)
        for rows, sounds in zip(videos, waveforms, strict=True)
    ]
