"""The dispatch line of a single request whose n exceeds the row cap (issue 22 item 7): requests, rows and the calls
it runs as, not a `size=10/8` that reads as a cap violation; other dispatches keep their line."""

from __future__ import annotations

from diffuserve.engine.metrics import format_dispatch
from diffuserve.engine.scheduler import ScheduledBatch


def _batch(rows: int, cap: int = 8, requests: int = 1) -> ScheduledBatch:
    return ScheduledBatch(
        requests=[object()] * requests,
        effective_cap=cap,
        user_max=8,
        num_outputs=rows,  # type: ignore[list-item]
        stop_reason="max_size",
        head_queue_wait_s=0.00512,
    )


def test_oversized_single_request_reads_as_calls():
    line = format_dispatch(_batch(10))
    assert line == (
        "Dynamic batch dispatch: requests=1, rows=10 in 2 calls of <= 8 rows, user_max=8, "
        "queue_wait=5.12ms, stop_reason=max_size"
    )
    assert "10/8" not in line


def test_other_dispatches_keep_their_line():
    assert format_dispatch(_batch(4, requests=2)) == (
        "Dynamic batch dispatch: size=4/8, user_max=8, queue_wait=5.12ms, stop_reason=max_size"
    )
