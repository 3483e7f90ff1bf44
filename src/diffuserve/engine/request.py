"""What a request is, inside the engine: its sampling parameters, identity, status and batch signature.

No torch and no I/O here: the scheduler imports this module and must stay pure.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field, fields
from typing import Any


def _sig(default: Any, doc: str) -> Any:
    """A field that belongs to the batch signature (changes the tensor program)."""
    return field(default=default, metadata={"signature": True, "doc": doc})


def _row(default: Any, doc: str) -> Any:
    """A per-row field: differs freely between requests merged into one batch."""
    return field(default=default, metadata={"signature": False, "doc": doc})


@dataclass(frozen=True)
class SamplingParams:
    """Everything a generation needs. Each field says whether it is part of the batch signature.

    The signature holds exactly what changes the tensor program (shape, steps, guidance, whether CFG
    runs); prompt, negative prompt, seed, n and output encoding are per row or applied after the
    split, so requests that differ only there can share one pipeline call.
    """

    prompt: str = _row("", "Text prompt.")
    negative_prompt: str | None = _row(None, "Negative prompt; enables true CFG when true_cfg_scale > 1.")
    width: int = _sig(64, "Output width in pixels.")
    height: int = _sig(64, "Output height in pixels.")
    num_frames: int = _sig(1, "Frames for video families; 1 for images.")
    fps: int = _row(16, "Frames per second of an encoded video.")
    num_inference_steps: int = _sig(4, "Denoising steps.")
    guidance_scale: float = _sig(3.5, "Guidance (embedded guidance for FLUX.1-dev-style models).")
    true_cfg_scale: float = _sig(1.0, "Classifier-free guidance scale; CFG runs when > 1 and a negative prompt is set.")
    guidance_scale_2: float | None = _sig(None, "Second-expert guidance (Wan2.2 A14B).")
    seed: int | None = _row(None, "Random seed; None draws one at submission.")
    n: int = _row(1, "Outputs for this prompt; each owns one row of the batch.")
    output_format: str = _row("png", "png | jpeg | webp (images), mp4 (video).")
    output_quality: int = _row(90, "Encoder quality for jpeg/webp (1-100).")
    image_inputs: tuple[bytes, ...] = _row((), "Encoded input images (edits / image conditioning).")
    strength: float = _sig(1.0, "Image-to-image: share of the schedule re-noised from the input image (0-1].")

    @property
    def cfg_enabled(self) -> bool:
        """Whether the classifier-free-guidance branch runs (doubles the rows of the batch)."""
        return self.true_cfg_scale > 1.0 and bool(self.negative_prompt)

    def signature(self) -> tuple[tuple[str, Any], ...]:
        """The batch signature: equal signatures run the same tensor program."""
        items = [(f.name, getattr(self, f.name)) for f in fields(self) if f.metadata.get("signature")]
        items.append(("cfg_enabled", self.cfg_enabled))
        return tuple(items)

    @classmethod
    def signature_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.metadata.get("signature")) + ("cfg_enabled",)


def signature_difference(a: SamplingParams, b: SamplingParams) -> str | None:
    """The first signature field that differs, as `sampling_params.<field>`; None when compatible."""
    for (name, va), (_, vb) in zip(a.signature(), b.signature(), strict=True):
        if va != vb:
            return f"sampling_params.{name}"
    return None


class RequestStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"
    TIMED_OUT = "timed_out"


@dataclass(eq=False)
class Request:
    """One accepted request. The engine owns it; the scheduler reads it and never does I/O with it."""

    request_id: str
    params: SamplingParams
    arrival_time: float
    """Clock time (scheduler clock) when the request was accepted."""
    model: str = ""
    """Public model name the request was served under (for batching rules)."""
    ineligible_reason: str | None = None
    """Why this request may never be merged with others (`image_conditioning`, `warmup`, ...)."""
    priority: int = 0
    """Lower runs first among queued requests; see the README's priority rule."""
    deadline: float | None = None
    """Scheduler-clock time after which the request is answered 504; None = no deadline."""
    status: RequestStatus = RequestStatus.QUEUED
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set when the client goes away or the deadline passes; checked between denoising steps."""

    @property
    def num_outputs(self) -> int:
        """Rows this request occupies in a batch (counts against the batch cap)."""
        return self.params.n

    @property
    def resolution(self) -> str:
        return f"{self.params.width}x{self.params.height}"
