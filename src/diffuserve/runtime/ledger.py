"""TransferLedger: every host<->device move of weights, and the device bytes they leave behind.

The residency runtime reports each move here (component, layer, bytes, direction, seconds). The
ledger keeps running totals of the bytes attached on the device (now and at peak, in total and per
component), a bounded history of moves, and a per-request window so tests and metrics can ask
"what did this request move, and which layers held device weights when". On a CPU-only machine
it is the only memory accounting there is; on CUDA `check_against_cuda()` holds it against the
allocator's own peak.

Thread-safe: the worker records while the metrics endpoint reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

Direction = Literal["h2d", "d2h", "free"]
DIRECTIONS: tuple[Direction, ...] = ("h2d", "d2h", "free")
"""h2d: weights attached on the device (a copy or a move); d2h: moved back to the host (a copy);
free: the device copy dropped with no copy back (a host copy already exists)."""


@dataclass(frozen=True)
class Move:
    """One recorded move and the device-byte totals right after it."""

    seq: int
    """Position in the ledger's history (0-based, never reused)."""
    component: str
    layer: str | None
    """Dotted path of the layer inside the component; None for the component as a whole or its
    non-layer weights."""
    direction: Direction
    nbytes: int
    seconds: float
    """Host-side time of the move. For an asynchronous CUDA prefetch this is the time to enqueue
    the copy, not the copy itself."""
    device_bytes_after: int
    """All components' attached bytes right after this move."""
    component_bytes_after: int
    """This component's attached bytes right after this move."""


@dataclass
class WindowSummary:
    """What happened between `begin_window()` and `window_summary()` (typically one request)."""

    moves: list[Move] = field(default_factory=list)
    """The moves of the window, in order."""
    bytes_moved: dict[str, dict[str, int]] = field(default_factory=dict)
    """component -> direction -> bytes."""
    seconds: dict[str, float] = field(default_factory=dict)
    """component -> seconds spent moving."""
    device_bytes_at_start: int = 0
    """Attached bytes (all components) when the window opened."""
    peak_device_bytes: int = 0
    """Highest attached bytes (all components) seen in the window, the start included."""
    truncated: bool = False
    """True when the history dropped some of the window's moves (see `max_history`); the byte
    totals are still complete, the move list is not."""

    def bytes(self, component: str | None = None, direction: Direction | None = None) -> int:
        """Bytes moved in the window, optionally for one component and/or direction."""
        total = 0
        for comp, per_dir in self.bytes_moved.items():
            if component is not None and comp != component:
                continue
            for d, n in per_dir.items():
                if direction is None or d == direction:
                    total += n
        return total


class MetricsSink(Protocol):
    """What `forward_to` needs from the engine's metrics (engine/metrics.py EngineMetrics fits)."""

    def record_transfer(self, component: str, direction: str, nbytes: int, seconds: float) -> None: ...

    def set_device_bytes(self, component: str, now: int, peak: int) -> None: ...


@dataclass
class CudaCheck:
    """The outcome of `TransferLedger.check_against_cuda()`."""

    ledger_peak_bytes: int
    cuda_peak_bytes: int
    baseline_bytes: int
    tolerance_bytes: int
    ok: bool
    message: str


class TransferLedger:
    """Thread-safe record of weight moves with device bytes now and at peak."""

    def __init__(self, *, max_history: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._moves: deque[Move] = deque(maxlen=max_history)
        self._seq = 0
        # (component, layer) -> bytes attached now; the finest grain the runtime reports.
        self._attached: dict[tuple[str, str | None], int] = {}
        self._component_now: dict[str, int] = {}
        self._component_peak: dict[str, int] = {}
        self._total_now = 0
        self._total_peak = 0
        self._totals: dict[str, dict[str, int]] = {}
        self._listeners: list[Callable[[Move], None]] = []
        # The open window: first seq, running byte/second totals, peak, bytes at start.
        self._win_start: int | None = None
        self._win_bytes: dict[str, dict[str, int]] = {}
        self._win_seconds: dict[str, float] = {}
        self._win_peak = 0
        self._win_device_at_start = 0

    # 1. Recording -----------------------------------------------------------------------------

    def record(
        self,
        component: str,
        layer: str | None,
        nbytes: int,
        direction: Direction,
        seconds: float = 0.0,
    ) -> Move:
        """Record one move. h2d adds `nbytes` to the attached bytes of (component, layer); d2h and
        free subtract them (more than is attached is a bookkeeping bug and raises ValueError)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        with self._lock:
            key = (component, layer)
            attached = self._attached.get(key, 0)
            if direction == "h2d":
                delta = nbytes
            else:
                if nbytes > attached:
                    raise ValueError(
                        f"ledger: {direction} of {nbytes} bytes for {component}/{layer} but only "
                        f"{attached} are attached"
                    )
                delta = -nbytes
            if attached + delta:
                self._attached[key] = attached + delta
            else:
                self._attached.pop(key, None)
            comp_now = self._component_now.get(component, 0) + delta
            self._component_now[component] = comp_now
            self._component_peak[component] = max(self._component_peak.get(component, 0), comp_now)
            self._total_now += delta
            self._total_peak = max(self._total_peak, self._total_now)
            per_dir = self._totals.setdefault(component, {})
            per_dir[direction] = per_dir.get(direction, 0) + nbytes
            move = Move(
                seq=self._seq,
                component=component,
                layer=layer,
                direction=direction,
                nbytes=nbytes,
                seconds=seconds,
                device_bytes_after=self._total_now,
                component_bytes_after=comp_now,
            )
            self._seq += 1
            self._moves.append(move)
            if self._win_start is not None:
                win_dir = self._win_bytes.setdefault(component, {})
                win_dir[direction] = win_dir.get(direction, 0) + nbytes
                self._win_seconds[component] = self._win_seconds.get(component, 0.0) + seconds
                self._win_peak = max(self._win_peak, self._total_now)
            listeners = list(self._listeners)
        # Listeners run outside the lock so a slow or re-entrant one cannot stall other recorders.
        for listener in listeners:
            try:
                listener(move)
            except Exception:  # metrics must never break inference
                logger.exception("transfer ledger listener %r failed", listener)
        return move

    def add_listener(self, listener: Callable[[Move], None]) -> Callable[[], None]:
        """Call `listener(move)` after every move; returns a function that removes it."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def forward_to(self, sink: MetricsSink) -> Callable[[], None]:
        """Forward every move to `sink.record_transfer(...)` and `sink.set_device_bytes(...)`
        (the engine's Prometheus metrics). Returns the remover."""

        def listener(move: Move) -> None:
            sink.record_transfer(move.component, move.direction, move.nbytes, move.seconds)
            sink.set_device_bytes(move.component, move.component_bytes_after, self.peak_bytes(move.component))

        return self.add_listener(listener)

    # 2. Reading -------------------------------------------------------------------------------

    def device_bytes(self, component: str | None = None) -> int:
        """Bytes attached on the device now (all components, or one)."""
        with self._lock:
            return self._total_now if component is None else self._component_now.get(component, 0)

    def peak_bytes(self, component: str | None = None) -> int:
        """Highest attached bytes since creation or the last `reset_peak()`."""
        with self._lock:
            return self._total_peak if component is None else self._component_peak.get(component, 0)

    def reset_peak(self) -> None:
        """Start peak tracking again from the bytes attached now."""
        with self._lock:
            self._total_peak = self._total_now
            self._component_peak = dict(self._component_now)

    def on_device(self) -> dict[str, set[str | None]]:
        """component -> the layers (None: its non-layer weights or the whole component) that hold
        device weights now."""
        with self._lock:
            out: dict[str, set[str | None]] = {}
            for component, layer in self._attached:
                out.setdefault(component, set()).add(layer)
            return out

    def totals(self) -> dict[str, dict[str, int]]:
        """component -> direction -> bytes moved since creation."""
        with self._lock:
            return {c: dict(d) for c, d in self._totals.items()}

    def moves(self, since: int = 0) -> list[Move]:
        """The kept history of moves with seq >= since."""
        with self._lock:
            return [m for m in self._moves if m.seq >= since]

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view for /server_info and logs."""
        with self._lock:
            return {
                "device_bytes": self._total_now,
                "peak_device_bytes": self._total_peak,
                "components": {
                    c: {"now": self._component_now.get(c, 0), "peak": self._component_peak.get(c, 0)}
                    for c in sorted(self._component_now)
                },
                "bytes_moved": {c: dict(d) for c, d in self._totals.items()},
            }

    # 3. Per-request windows -------------------------------------------------------------------

    def begin_window(self) -> int:
        """Open a window (closing any open one); returns the seq of its first move."""
        with self._lock:
            self._win_start = self._seq
            self._win_bytes = {}
            self._win_seconds = {}
            self._win_peak = self._total_now
            self._win_device_at_start = self._total_now
            return self._seq

    def window_summary(self) -> WindowSummary:
        """What moved since `begin_window()`; the window stays open (call begin_window for the next)."""
        with self._lock:
            if self._win_start is None:
                raise RuntimeError("window_summary() called before begin_window()")
            start = self._win_start
            moves = [m for m in self._moves if m.seq >= start]
            truncated = bool(self._seq > start and (not self._moves or self._moves[0].seq > start))
            return WindowSummary(
                moves=moves,
                bytes_moved={c: dict(d) for c, d in self._win_bytes.items()},
                seconds=dict(self._win_seconds),
                device_bytes_at_start=self._win_device_at_start,
                peak_device_bytes=self._win_peak,
                truncated=truncated,
            )

    # 4. CUDA cross-check ----------------------------------------------------------------------

    def check_against_cuda(
        self,
        *,
        baseline_bytes: int = 0,
        rel_tol: float = 0.02,
        abs_tol_bytes: int = 4 << 20,
        device: Any = None,
    ) -> CudaCheck:
        """Compare the ledger's peak with `torch.cuda.max_memory_allocated`.

        The allocator's peak also holds activations, workspaces and whatever was allocated before
        the runtime started (pass it as `baseline_bytes`, e.g. `memory_allocated()` before loading),
        so it can only be *higher* than the weight peak the ledger sees. The check therefore
        asserts the one direction that must hold: `cuda_peak - baseline >= ledger_peak - tol`,
        where tol = max(abs_tol_bytes, rel_tol * ledger_peak) absorbs allocator rounding (blocks
        are rounded up to 512 bytes, so weight bytes are never under-counted by it) and tensors
        freed by the caching allocator a little earlier than the ledger records them. A ledger
        peak above the allocator's means the ledger counts a move that did not happen.
        """
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("check_against_cuda() needs a CUDA device; this machine has none")
        torch.cuda.synchronize(device)
        cuda_peak = int(torch.cuda.max_memory_allocated(device))
        ledger_peak = self.peak_bytes()
        tol = max(abs_tol_bytes, int(rel_tol * ledger_peak))
        ok = cuda_peak - baseline_bytes >= ledger_peak - tol
        message = (
            f"ledger peak {ledger_peak} B, CUDA peak {cuda_peak} B (baseline {baseline_bytes} B, "
            f"tolerance {tol} B): {'consistent' if ok else 'the ledger counts more than CUDA allocated'}"
        )
        return CudaCheck(ledger_peak, cuda_peak, baseline_bytes, tol, ok, message)


def timed() -> Callable[[], float]:
    """`elapsed = timed(); ...; seconds = elapsed()` — a small helper for recorders."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
