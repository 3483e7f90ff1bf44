"""What a request is, inside the engine: its sampling parameters (`diffuserve.sampling`), identity and status.

No torch and no I/O here: the scheduler imports this module and must stay pure.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from diffuserve.sampling import SamplingParams


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
    activation_bytes: int = 0
    """The request's activation-memory estimate (`diffuserve/activation.py`); the schedulers start it only when it
    fits in the budget beside what runs."""
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
