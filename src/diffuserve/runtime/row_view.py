"""Which rows of a denoiser call a narrowed block call runs.

A step cache runs the blocks after its decision on the rows that compute at this step only
(`pipelines/step_cache.py`). Per-row state that is laid out by the rows of the whole call — LoRA's row -> adapter
assignment (`lora/layers.py`) — listens for the narrowing and follows it while the narrowed blocks run. Both live on
the batch's own thread, so the listeners are per thread (a context variable); narrowing happens outside compiled
code (the step cache's bookkeeping is not traced), so compiled layers only see the state the listeners set.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class RowView:
    """Rows `rows` (positions in the full call, in order) of a call of `full` rows."""

    rows: tuple[int, ...]
    """The call's rows the narrowed inputs hold, row i of the inputs being row `rows[i]` of the call."""
    full: int
    """Rows of the whole call (a doubled CFG batch counts both halves)."""


Listener = Callable[[RowView], Callable[[], None]]
"""Called when a call is narrowed; returns what restores its state when the narrowing ends."""

_LISTENERS: contextvars.ContextVar[tuple[Listener, ...]] = contextvars.ContextVar("diffuserve_row_view", default=())


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Within: `listener` hears every narrowing on this thread."""
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield
    finally:
        _LISTENERS.reset(token)


@contextmanager
def narrowed_to(rows: tuple[int, ...], full: int) -> Iterator[None]:
    """Within: the layers called run rows `rows` of a `full`-row call."""
    view = RowView(tuple(rows), full)
    restores = [listener(view) for listener in _LISTENERS.get()]
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()
