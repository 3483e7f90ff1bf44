"""Dynamic batching's encode overlap: the texts of requests queued behind a running batch are encoded in the
pipeline's encode lane (`pipelines/lanes.py`) while that batch denoises, and their batch picks them up.

Queued requests are encoded together, not one by one: a request's texts join the lane job of its batch
signature that is still waiting to start (one job per signature at most waits), so the texts that queued while
the lane was busy go through each text encoder in ONE call, as the batch's own `encode_batch` and diffusers do.
Rows are cut back per text (`gather_rows` trims masked sequences to the text's own length) and kept per
(text, batch signature) until its batch takes them: a merged batch assembles its per-text rows from these and
from the texts it still has to encode, padding masked sequences as `concat_cond` does, so a row equals its
singleton's conditioning (a fixed-length family, FLUX's T5 and CLIP, pads every text to the same length, so a
text's row is the same computation alone or in a batch; variable-length families differ only by the float
rounding of a batched matmul, far below 1/255 of a pixel). Entries are taken once; at most `MAX_ENTRIES` wait
(the oldest are dropped), so a cancelled request never pins memory for long.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffuserve.pipelines.lanes import SideResult, lanes_for

logger = logging.getLogger(__name__)

MAX_ENTRIES = 32
"""Prefetched texts kept at most (about two full batches of requests with CFG)."""
MAX_JOB_TEXTS = 16
"""Texts one lane job encodes at most (a full batch of 8 with CFG); more start the next job."""

Cond = dict[str, torch.Tensor]


@dataclass
class _Job:
    """A lane job that has not started yet: queued requests' texts of one batch signature join it."""

    members: list[Any]
    """The member requests, the opening one first (one signature): the encode sees them as its batch, so a
    family that encodes a text by its role (SANA's prompts and negatives differ) finds every member's prompt."""
    texts: list[str]
    """Distinct texts to encode, in arrival order."""
    callbacks: list[Callable[[int], None] | None] = field(default_factory=list)
    """Each member request's `on_done`."""
    started: bool = False
    """Set (under the lock) when the lane starts it: later requests open a new job."""


class TextPrefetch:
    """The prefetched text conditionings of one pipeline."""

    def __init__(self, pipeline: Any, encode_many: Callable[[list[str], list[Any]], list[Cond]]):
        self.pipeline = pipeline
        self.encode_many = encode_many
        """encode_many(texts, requests) -> one one-row conditioning per text (one call per text encoder); the
        requests whose texts they are form the encode's batch."""
        self._entries: OrderedDict[tuple[str, str], tuple[Cond, Any]] = OrderedDict()
        self._pending: set[tuple[str, str]] = set()
        self._waiting: dict[str, _Job] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(text: str, params: Any) -> tuple[str, str]:
        return text, repr(params.signature())

    def submit(self, params: Any, texts: Sequence[str], on_done: Callable[[int], None] | None = None) -> bool:
        """Queue the encode of `texts` (of the queued request `params`) in the encode lane; False if none needed.
        `on_done(steps_beside)` gets the denoising steps the loop ran while the encode ran."""
        signature = repr(params.signature())
        with self._lock:
            todo = [
                t
                for t in dict.fromkeys(texts)
                if (t, signature) not in self._entries and (t, signature) not in self._pending
            ]
            if not todo:
                return False
            self._pending.update((t, signature) for t in todo)
            job = self._waiting.get(signature)
            if job is not None and len(job.texts) + len(todo) <= MAX_JOB_TEXTS:
                job.texts.extend(todo)  # rides along with the job that has not started yet
                job.callbacks.append(on_done)
                job.members.append(params)  # its carried token ids too (the encode reads them from its batch)
                return True
            job = self._waiting[signature] = _Job([params], todo, [on_done])

        def run() -> dict[str, Cond]:
            with self._lock:  # from now on the job's texts are fixed
                job.started = True
                if self._waiting.get(signature) is job:
                    del self._waiting[signature]
                texts, members = list(job.texts), list(job.members)
            return dict(zip(texts, self.encode_many(texts, members), strict=True))

        future = lanes_for(self.pipeline).encode.submit(run, prompts=[params.prompt])
        future.add_done_callback(lambda f: self._store(signature, job, f))
        return True

    def _store(self, signature: str, job: _Job, future: Any) -> None:
        with self._lock:
            self._pending.difference_update((t, signature) for t in job.texts)
            if self._waiting.get(signature) is job:  # the lane never ran it
                del self._waiting[signature]
            try:
                side: SideResult[dict[str, Cond]] = future.result()
            except Exception:  # the batch encodes the text itself
                logger.warning("prefetching a text encode failed; its batch encodes it", exc_info=True)
                return
            for text, cond in side.value.items():
                self._entries[(text, signature)] = (cond, side.event)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
        for on_done in job.callbacks:
            if on_done is not None:
                on_done(side.steps_beside)

    def take(self, text: str, params: Any) -> Cond | None:
        """The prefetched conditioning of `text` for a batch headed by `params` (removed), or None."""
        with self._lock:
            entry = self._entries.pop(self.key(text, params), None)
        if entry is None:
            return None
        cond, event = entry
        if event is not None:  # CUDA: the loop's stream waits for the encode lane's work
            torch.cuda.current_stream(event.device).wait_event(event)
        return cond

    @property
    def num_entries(self) -> int:
        """Prefetched texts waiting for their batch (what the tests and a debugger look at)."""
        with self._lock:
            return len(self._entries)
