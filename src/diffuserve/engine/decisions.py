"""What the request scheduler hands the engine: a batch and how it was formed, or a wait (engine/scheduler.py).

Pure data, no torch: the schedulers, the loops, the metrics and the dispatch log line read these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from diffuserve.engine.request import Request


@dataclass
class ScheduledBatch:
    """One batch handed to the worker: the requests and how and why it was formed."""

    requests: list[Request]
    """Head first, then the joined requests in the order they were taken."""
    effective_cap: int
    """Outputs this batch could hold: min(user max, rule cap); 1 when merging is off."""
    user_max: int
    """`--batching-max-size`."""
    num_outputs: int
    """Rows of the batch: the sum of the requests' `n`."""
    stop_reason: str
    """`max_size`, `config_cap:N`, `max_tokens`, `delay`, `dynamic_disabled` or `head:<reason>`."""
    head_queue_wait_s: float
    """How long the head waited in the queue before this dispatch, in seconds."""
    rejects: dict[str, int] = field(default_factory=dict)
    """Queued candidates left out of this batch, counted by reason."""
    dispatch_time: float = 0.0
    """Scheduler-clock time of the dispatch."""
    batch_id: int = 0
    """Increasing number of the dispatch (1 for the first batch of a scheduler)."""
    num_tokens: int = 0
    """Latent tokens of the batch: the sum over its requests of `Request.tokens` (config/token_budget.py)."""
    token_budget: int | None = None
    """The token budget it was filled against (`--batching-max-tokens`, resolved); None: rows only."""
    num_sizes: int = 1
    """Distinct sizes (width, height, frames) among its rows: more than one makes it a packed call."""
    padding_tokens: int = 0
    """Tokens a rectangular (padded) call of these rows would add: rows x the largest row's tokens - `num_tokens`;
    0 for one size. A packed call does not compute them: the waste packing saves (docs/batching.md)."""

    @property
    def packed(self) -> bool:
        """Whether rows of different sizes share this call (a family that packs mixed sizes)."""
        return self.num_sizes > 1

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def is_full(self) -> bool:
        """Whether the batch reached its effective cap or its token budget (an oversized single request counts as
        full)."""
        return self.num_outputs >= self.effective_cap or self.stop_reason == "max_tokens"

    @property
    def capacity(self) -> int:
        """Outputs this dispatch could have held: the cap, or the rows of an oversized single request."""
        return max(self.effective_cap, self.num_outputs)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]


@dataclass(frozen=True)
class Dispatch:
    """Run this batch now."""

    batch: ScheduledBatch


@dataclass(frozen=True)
class WaitUntil:
    """A batch is forming: call `schedule` again at `time` (or earlier, when a request arrives)."""

    time: float


@dataclass(frozen=True)
class Idle:
    """Nothing to dispatch: the queue is empty, or a batch is running (`busy`)."""

    busy: bool = False


Decision = Dispatch | WaitUntil | Idle


def batch_facts(requests: Sequence[Request]) -> dict[str, int]:
    """The token figures of a batch of `requests`: tokens, distinct sizes and the padding a rectangular call of
    its rows would add (`ScheduledBatch`'s fields of the same names)."""
    tokens = sum(r.tokens for r in requests)
    rows = sum(r.num_outputs for r in requests)
    longest = max((r.tokens_per_row for r in requests), default=0)
    return {
        "num_tokens": tokens,
        "num_sizes": len({r.size_key for r in requests}),
        "padding_tokens": rows * longest - tokens,
    }
