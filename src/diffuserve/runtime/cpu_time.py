"""CPU time the process spent inside pipeline calls, so serving overhead (the rest) can be measured.

Each pipeline call (the worker thread's `run` / `run_to_latents`, every side-lane job: prefetched encodes,
deferred decodes) adds its own thread's CPU time (`time.thread_time`) here. `/metrics` exports the total as
`diffuserve_pipeline_cpu_seconds` beside the process's CPU time (`diffuserve_process_cpu_seconds_total`):
their difference per image is the serving CPU per image (HTTP, JSON, PNG/base64, scheduling, the event loop),
the figure `benchmarks/bench_overhead.py` reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class CpuAccount:
    """A thread-safe running total of thread CPU seconds."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._lock = threading.Lock()

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Add the calling thread's CPU time spent inside the block (only this thread: no double counting)."""
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with self._lock:
                self._seconds += spent

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._seconds


PIPELINE_CPU = CpuAccount()
"""Every pipeline call of this process."""
