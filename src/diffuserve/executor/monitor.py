"""Rank 0's watch over every other rank: its local child processes, the faults ranks report, their heartbeats.

A rank whose process exits, that reports a fault, or whose heartbeat stops for `--dist-heartbeat-timeout-s` is
declared faulty once (`on_fault(rank, message naming it)`); the executor then fails its replica and the engine
answers every request with that message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from diffuserve.executor.protocol import RankLink

logger = logging.getLogger("diffuserve.executor")

_MONITOR_INTERVAL_S = 0.25


class RankMonitor:
    """Watches every other rank: local child processes, fault reports, heartbeats."""

    def __init__(
        self,
        ranks: RankLink,
        world_size: int,
        *,
        heartbeat_timeout_s: float,
        children: dict[int, Any],
        on_fault: Callable[[int, str], None],
        describe: Callable[[int], str],
    ):
        self.ranks, self.world_size, self.timeout_s = ranks, world_size, heartbeat_timeout_s
        self.children, self.on_fault, self.describe = children, on_fault, describe
        self.fault: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="diffuserve-rank-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _check(self, rank: int, seen: dict[int, tuple[int, float]], now: float) -> str | None:
        child = self.children.get(rank)
        if child is not None and child.exitcode is not None:
            how = f"signal {-child.exitcode}" if child.exitcode < 0 else f"exit code {child.exitcode}"
            return f"{self.describe(rank)} exited ({how})"
        reported = self.ranks.fault(rank)
        if reported:
            return f"{self.describe(rank)} failed: {reported}"
        count = self.ranks.heartbeats(rank)
        last_count, since = seen.get(rank, (-1, now))
        if count != last_count:
            seen[rank] = (count, now)
        elif count > 0 and now - since > self.timeout_s:
            return f"{self.describe(rank)} sent no heartbeat for {now - since:.0f}s (hung or unreachable)"
        return None

    def _main(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                for rank in range(1, self.world_size):
                    fault = self._check(rank, seen, now)
                    if fault:
                        self._declare(rank, fault)
                        return
            except Exception as exc:  # the store itself broke
                self._declare(-1, f"the rank group's store failed ({type(exc).__name__}: {exc})")
                return
            self._stop.wait(_MONITOR_INTERVAL_S)

    def _declare(self, rank: int, fault: str) -> None:
        if self.fault is None:
            self.fault = fault
            logger.error("rank fault: %s", fault)
            self.on_fault(rank, fault)
