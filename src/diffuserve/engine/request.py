"""What a request is, inside the engine: its sampling parameters (`diffuserve.sampling`), identity and status.

No torch and no I/O here: the scheduler imports this module and must stay pure.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from diffuserve.config.token_budget import row_tokens
from diffuserve.sampling import SamplingParams

DEFAULT_TOKEN_SIDE = 16
"""Pixels per token side of a request whose `row_tokens` was not set (FLUX.1 / SD3 / Qwen-Image's 8 x 2)."""


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
    row_tokens: int = 0
    """Latent tokens of one output row at this request's size (`config.token_budget.row_tokens` with the served
    model's token side, set at admission); 0: counted with a 16-pixel token side (tests, warm-up)."""
    status: RequestStatus = RequestStatus.QUEUED
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set when the client goes away or the deadline passes; checked between denoising steps."""

    @property
    def num_outputs(self) -> int:
        """Rows this request occupies in a batch (counts against the batch cap)."""
        return self.params.n

    @property
    def tokens_per_row(self) -> int:
        """`row_tokens`, or the size's tokens at a 16-pixel token side when it was not set."""
        if self.row_tokens > 0:
            return self.row_tokens
        p = self.params
        return row_tokens(p.width, p.height, p.num_frames, token_side=DEFAULT_TOKEN_SIDE, frames_per_latent=4)

    @property
    def tokens(self) -> int:
        """Latent tokens this request adds to a batch: its rows x `tokens_per_row` (the token budget's unit)."""
        return self.num_outputs * self.tokens_per_row

    @property
    def size_key(self) -> tuple[int, int, int]:
        """(width, height, num_frames): rows of different size keys in one call make it a packed call."""
        return self.params.width, self.params.height, self.params.num_frames

    @property
    def resolution(self) -> str:
        return f"{self.params.width}x{self.params.height}"
