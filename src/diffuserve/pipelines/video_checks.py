"""Request checks every native video family shares."""

from __future__ import annotations

from diffuserve.errors import InvalidRequestError


def check_frame_count(num_frames: int, step: int, *, model: str, vae: str = "VAE") -> None:
    """400 naming `num_frames` unless it is k x `step` + 1 (the VAE's time compression), with the two nearest
    counts that fit. `model` and `vae` name the checkpoint and its video VAE in the message."""
    if num_frames < 1 or (num_frames - 1) % step:
        below = max(1, (num_frames - 1) // step * step + 1)
        raise InvalidRequestError(
            f"num_frames={num_frames} does not fit this {model} checkpoint: it needs {step}k+1 frames (its {vae} "
            f"compresses time {step}x); use {below} or {below + step}.",
            param="num_frames",
        )
