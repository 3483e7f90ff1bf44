"""The rows of the denoiser call in progress: one frozen `DenoiseCall`, set by the recipe, read by every hook.

Per-row state that the layers inside a denoiser need — which adapters and scales each row applies (LoRA,
`lora/layers.py`), each row's step-cache history and CFG branch (`step_cache/hooks.py`) — is described once
per call by the recipe; sequence parallel adds the call's token split when the transformer is entered
(`parallel/sequence_split.py`). The call is entered with `calling`; a hook reads `current()` and nothing else.
A step cache that runs its blocks on the rows that compute only (or the recipe on the rows that have started,
`pipelines/inpaint.py`) enters `narrowed(view)`: the same call, each per-row part cut to those rows, so a layer
laid out by the rows of the whole call follows without being told.

Why a thread-local and not a `contextvars.ContextVar`: the call runs on the one thread that runs the batch (as a
context variable would be, outside asyncio), and compiled code reads it too (`--enable-torch-compile` traces the
adapted Linears inside the blocks): dynamo cannot trace `ContextVar.get` (a graph break at every layer), but it
traces a thread-local's attribute and guards on it without recompiling when another call is entered (measured with
torch 2.x's `eager` backend; `tests/integration/test_lora_compile.py` counts the graphs).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class RowView:
    """Rows `rows` (positions in the full call, in order) of a call of `full` rows."""

    rows: tuple[int, ...]
    """The call's rows the narrowed inputs hold, row i of the inputs being row `rows[i]` of the call."""
    full: int
    """Rows of the whole call (a doubled CFG batch counts both halves)."""


class RowAdapters(Protocol):
    """LoRA's per-row part of a call (`lora/layers.py` `RowAssignment`): what it needs to follow a narrowing."""

    def narrowed(self, view: RowView) -> RowAdapters:
        """The same adapters for the rows `view` keeps."""
        ...


@dataclass(frozen=True)
class DenoiseCall:
    """The rows of one denoiser call, per row: its adapters and scales, its step cache and CFG branch.

    Each part is laid out by the rows of the call and is None when no row uses it."""

    adapters: Any = None
    """Per row, the adapter slots and scales it applies (a `RowAdapters`: `lora/layers.py` `RowAssignment`)."""
    cache: Any = None
    """Per row, its step-cache history and CFG branch (`step_cache/rows.py` `CallRows`); it also holds
    the span the cache's first block hands the later ones (`step_cache/hooks.py`)."""
    view: RowView | None = None
    """Set while blocks run on some rows of the call only (`narrowed`); None: every row."""
    packed: Any = None
    """A packed mixed-size call's rows (`pipelines/packing.py` `PackedRows`: each row's text and image tokens, the
    padding masks), set around the packed denoiser call; None: the rows are not packed."""
    split: Any = None
    """The call's sequence-parallel token split (`parallel/sequence.py`), set by its hook on the transformer while
    the transformer runs; None: not split."""
    split_attention: bool = False
    """Set while one of the split call's joint self-attention modules runs (its attention dispatch acts then)."""

    def narrowed(self, view: RowView) -> DenoiseCall:
        """This call on the rows `view` keeps: the per-row parts that layers read follow the rows."""
        adapters = self.adapters.narrowed(view) if self.adapters is not None else None
        return dataclasses.replace(self, adapters=adapters, view=view)


class _Current(threading.local):
    call: DenoiseCall | None = None


_CURRENT = _Current()


def current() -> DenoiseCall | None:
    """The call in progress on this thread (None: outside any, every hook is the plain layer)."""
    return _CURRENT.call


@contextmanager
def calling(call: DenoiseCall | None) -> Iterator[DenoiseCall | None]:
    """Within: `call` is the call in progress on this thread (None: none); the previous one comes back after."""
    before = _CURRENT.call
    _CURRENT.call = call
    try:
        yield call
    finally:
        _CURRENT.call = before


def swap(call: DenoiseCall | None) -> DenoiseCall | None:
    """Make `call` the call in progress and return the one before it: for hooks that enter and leave in two
    functions (a forward pre-hook and its forward hook), which put the returned one back."""
    before = _CURRENT.call
    _CURRENT.call = call
    return before


@contextmanager
def with_parts(**parts: Any) -> Iterator[DenoiseCall]:
    """Within: the call in progress with `parts` (DenoiseCall fields) set; a new call when there is none."""
    before = _CURRENT.call
    with calling(dataclasses.replace(before, **parts) if before is not None else DenoiseCall(**parts)) as call:
        yield call  # type: ignore[misc]


@contextmanager
def narrowed(rows: tuple[int, ...], full: int) -> Iterator[None]:
    """Within: the layers called run rows `rows` of a `full`-row call (nothing changes outside a call)."""
    before = _CURRENT.call
    if before is None:
        yield
        return
    with calling(before.narrowed(RowView(tuple(rows), full))):
        yield
