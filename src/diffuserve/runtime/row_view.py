"""Which rows of a denoiser call a narrowed block call runs.

A step cache runs the blocks after its decision on the rows that compute at this step only
(`pipelines/step_cache.py`). Per-row state that is laid out by the rows of the whole call — LoRA's row -> adapter
assignment (`lora/layers.py`) — reads the view to follow the narrowing. One view per thread (a context variable):
the batch's own thread sets it around the narrowed block and the adapted layers inside read it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class RowView:
    """Rows `rows` (positions in the full call, in order) of a call of `full` rows."""

    rows: tuple[int, ...]
    """The call's rows the narrowed inputs hold, row i of the inputs being row `rows[i]` of the call."""
    full: int
    """Rows of the whole call (a doubled CFG batch counts both halves)."""


_VIEW: contextvars.ContextVar[RowView | None] = contextvars.ContextVar("diffuserve_row_view", default=None)


@contextmanager
def narrowed_to(rows: tuple[int, ...], full: int) -> Iterator[None]:
    """Within: the layers called run rows `rows` of a `full`-row call."""
    token = _VIEW.set(RowView(tuple(rows), full))
    try:
        yield
    finally:
        _VIEW.reset(token)


def current_view() -> RowView | None:
    """The narrowing in force on this thread, or None (the layers see every row of the call)."""
    return _VIEW.get()
