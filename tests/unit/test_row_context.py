"""The per-call row context (runtime/row_context.py): what a hook reads, on which thread, and how a narrowing
carries the per-row parts with the rows."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from diffuserve.runtime import row_context
from diffuserve.runtime.row_context import DenoiseCall, RowView


@dataclass(frozen=True)
class _Scales:
    """A stand-in for LoRA's per-row part: one scale per row of the call."""

    per_row: tuple[float, ...]

    def narrowed(self, view: RowView) -> _Scales:
        assert len(self.per_row) == view.full
        return _Scales(tuple(self.per_row[i] for i in view.rows))


def test_a_call_is_seen_inside_and_the_previous_one_comes_back_after() -> None:
    assert row_context.current() is None
    outer = DenoiseCall(cache="outer-cache")
    with row_context.calling(outer):
        assert row_context.current() is outer
        with row_context.with_parts(packed="rows") as inner:
            assert row_context.current() is inner
            assert (inner.cache, inner.packed) == ("outer-cache", "rows")
        assert row_context.current() is outer
    assert row_context.current() is None


def test_narrowing_cuts_the_per_row_parts_to_the_rows_that_compute() -> None:
    call = DenoiseCall(adapters=_Scales((0.0, 0.5, 1.0, 2.0)), cache="cache")
    with row_context.calling(call), row_context.narrowed((1, 3), 4):
        seen = row_context.current()
        assert seen is not None
        assert seen.adapters == _Scales((0.5, 2.0))
        assert seen.view == RowView((1, 3), 4)
        assert seen.cache == "cache"
    with row_context.narrowed((0,), 4):  # outside a call nothing changes
        assert row_context.current() is None


def test_another_thread_never_sees_this_threads_call() -> None:
    """Each batch runs on its own thread: a call entered on one is invisible to another."""
    entered, checked = threading.Event(), threading.Event()
    seen: list[object] = []

    def other() -> None:
        entered.wait(timeout=10)
        seen.append(row_context.current())
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with row_context.calling(DenoiseCall(cache="mine")):
        entered.set()
        assert checked.wait(timeout=10)
    thread.join(timeout=10)
    assert seen == [None]
