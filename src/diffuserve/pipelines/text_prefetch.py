"""Dynamic batching's encode overlap: the texts of requests queued behind a running batch are encoded in the
pipeline's encode lane (`pipelines/overlap.py`) while that batch denoises, and their batch picks them up.

Each text is encoded alone, exactly as a singleton run of the request encodes it (the same `encode_text` calls,
under the same encoder lock and residency scope), and kept per (text, batch signature) until its batch takes it:
a merged batch assembles its per-text rows from these and from the texts it still has to encode, padding masked
sequences as `concat_cond` does, so a row equals its singleton's conditioning. Entries are taken once; at most
`MAX_ENTRIES` wait (the oldest are dropped), so a cancelled request never pins memory for long.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffuserve.pipelines.overlap import SideResult, overlap_for

logger = logging.getLogger(__name__)

MAX_ENTRIES = 32
"""Prefetched texts kept at most (about two full batches of requests with CFG)."""

Cond = dict[str, torch.Tensor]


class TextPrefetch:
    """The prefetched text conditionings of one pipeline."""

    def __init__(self, pipeline: Any, encode_alone: Callable[[str, Any], Cond]):
        self.pipeline = pipeline
        self.encode_alone = encode_alone
        """encode_alone(text, params) -> that text's one-row conditioning from every text encoder."""
        self._entries: OrderedDict[tuple[str, str], tuple[Cond, Any]] = OrderedDict()
        self._pending: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @staticmethod
    def key(text: str, params: Any) -> tuple[str, str]:
        return text, repr(params.signature())

    def submit(self, params: Any, texts: Sequence[str], on_done: Callable[[int], None] | None = None) -> bool:
        """Queue the encode of `texts` (of the queued request `params`) in the encode lane; False if none needed.
        `on_done(steps_beside)` gets the denoising steps the loop ran while the encode ran."""
        with self._lock:
            todo = [t for t in dict.fromkeys(texts)
                    if self.key(t, params) not in self._entries and self.key(t, params) not in self._pending]
            self._pending.update(self.key(t, params) for t in todo)
        if not todo:
            return False

        def job() -> dict[str, Cond]:
            return {t: self.encode_alone(t, params) for t in todo}

        future = overlap_for(self.pipeline).encode.submit(job, prompts=[params.prompt])
        future.add_done_callback(lambda f: self._store(params, todo, f, on_done))
        return True

    def _store(self, params: Any, todo: list[str], future: Any, on_done: Callable[[int], None] | None) -> None:
        with self._lock:
            self._pending.difference_update(self.key(t, params) for t in todo)
            try:
                side: SideResult[dict[str, Cond]] = future.result()
            except Exception:  # the batch encodes the text itself
                logger.warning("prefetching a text encode failed; its batch encodes it", exc_info=True)
                return
            for text, cond in side.value.items():
                self._entries[self.key(text, params)] = (cond, side.event)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
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
