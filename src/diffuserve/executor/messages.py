"""The executor seam's data: a scheduled batch (`BatchMessage`) and the events a running batch reports
(`Progress`, `Preview`), one shape in this process and across ranks; and `PreviewSink`, where one streaming
request's previews go (in its own process: it holds a callback; the engine, the remote client and the engine
process import it from here). The multi-rank transport's own messages (pipeline calls, continuous steps, reports)
and every store key live in executor/protocol.py.

Between ranks they travel through the TCP store of the process group (executor/protocol.py, executor/channel.py),
never through a collective, so a rank waiting for work is not blocked inside a collective (STACK.md's idle trap)
and a dead peer shows up as a missing heartbeat instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from diffuserve.sampling import SamplingParams


@dataclass(frozen=True)
class BatchMessage:
    """One scheduled batch for a replica: the engine -> the executor (and rank 0 -> a remote replica's leader)."""

    seq: int = 0
    """Sequence number of the message on its replica (0, 1, 2 ...; set by the executor that posts it)."""
    kind: Literal["batch", "shutdown"] = "batch"
    """batch: run it; shutdown: leave the serving loop."""
    request_ids: tuple[str, ...] = ()
    """The batch's requests, in order."""
    params: tuple[SamplingParams, ...] = ()
    """Each request's sampling parameters (same order as request_ids)."""
    max_rows: int | None = None
    """Row cap of every pipeline call of the batch (dynamic mode), None = one call."""
    compile_warmup: bool = False
    """The engine's warm-up batch: the replica runs it inside its residency's compile_warmup()."""
    previews: tuple[tuple[str, int], ...] = ()
    """(request id, partial images wanted) of the streaming requests: they get `Preview` events."""
    defer_decode: bool = False
    """Decode overlap: the executor may return once the batch is denoised, its decode running in the decode lane
    (`BatchOutcome.decoded`); an executor that cannot defer returns the complete outcome."""

    @property
    def partial_images(self) -> dict[str, int]:
        """`previews` as a dict."""
        return dict(self.previews)


@dataclass(frozen=True)
class Progress:
    """A running batch finished a denoising step (counted over all its pipeline calls)."""

    step: int
    """Index of the step just done (0-based)."""
    num_steps: int
    """Steps of the whole batch."""


@dataclass(frozen=True)
class Preview:
    """A partial image of one streaming request, made after a denoising step."""

    request_id: str
    """The request it belongs to."""
    index: int
    """Which of the request's partial images it is (0-based)."""
    images: list[Any]
    """One PIL image per output row of the request."""


BatchEvent = Progress | Preview
"""What a running batch reports while it runs."""


@dataclass
class PreviewSink:
    """Where one request's partial images go while its batch denoises (streaming requests)."""

    partial_images: int
    """How many previews the request asked for (0-3)."""
    deliver: Callable[[int, list[Any]], None]
    """deliver(partial_image_index, images): one PIL image per output row of the request. Called from the
    worker thread, so it must only hand the images over (e.g. `loop.call_soon_threadsafe`)."""
