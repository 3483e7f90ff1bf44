"""TransferLedger on its own: totals, peaks, windows, listeners, thread safety."""

from __future__ import annotations

import threading

import pytest

from diffuserve.runtime.ledger import Move, TransferLedger


def test_device_bytes_now_and_peak_per_component() -> None:
    led = TransferLedger()
    led.record("transformer", "blocks.0", 100, "h2d")
    led.record("transformer", "blocks.1", 50, "h2d")
    led.record("vae", None, 30, "h2d")
    assert led.device_bytes() == 180
    assert led.device_bytes("transformer") == 150
    led.record("transformer", "blocks.0", 100, "free")
    led.record("vae", None, 30, "d2h")
    assert led.device_bytes() == 50
    assert led.device_bytes("vae") == 0
    assert led.peak_bytes() == 180
    assert led.peak_bytes("transformer") == 150
    assert led.peak_bytes("vae") == 30
    assert led.on_device() == {"transformer": {"blocks.1"}}
    assert led.device_bytes("transformer") == 50  # blocks.1 alone
    led.reset_peak()
    assert led.peak_bytes() == 50


def test_moves_carry_running_totals() -> None:
    led = TransferLedger()
    a = led.record("t", "l0", 10, "h2d", 0.5)
    b = led.record("t", "l1", 20, "h2d")
    c = led.record("t", "l0", 10, "free")
    assert [m.seq for m in (a, b, c)] == [0, 1, 2]
    assert [m.device_bytes_after for m in (a, b, c)] == [10, 30, 20]
    assert c.component_bytes_after == 20
    assert a.seconds == 0.5
    assert led.totals() == {"t": {"h2d": 30, "free": 10}}


def test_window_counts_only_its_moves_and_its_own_peak() -> None:
    led = TransferLedger()
    led.record("te", None, 1000, "h2d")
    led.record("te", None, 1000, "d2h")
    start = led.begin_window()
    assert start == 2
    led.record("dit", "b.0", 40, "h2d")
    led.record("dit", "b.1", 40, "h2d")
    led.record("dit", "b.0", 40, "free")
    led.record("dit", "b.1", 40, "free")
    s = led.window_summary()
    assert s.bytes_moved == {"dit": {"h2d": 80, "free": 80}}
    assert s.bytes("dit", "h2d") == 80
    assert s.bytes(direction="d2h") == 0
    assert s.bytes() == 160
    assert [m.layer for m in s.moves] == ["b.0", "b.1", "b.0", "b.1"]
    # The window's peak is its own (80), not the earlier 1000 of the ledger's lifetime.
    assert s.peak_device_bytes == 80
    assert s.device_bytes_at_start == 0
    assert led.peak_bytes() == 1000
    assert not s.truncated


def test_window_before_begin_raises() -> None:
    with pytest.raises(RuntimeError, match="begin_window"):
        TransferLedger().window_summary()


def test_history_bound_marks_window_truncated_but_keeps_totals() -> None:
    led = TransferLedger(max_history=3)
    led.begin_window()
    for i in range(5):
        led.record("c", f"l{i}", 1, "h2d")
    s = led.window_summary()
    assert s.truncated
    assert len(s.moves) == 3
    assert s.bytes("c", "h2d") == 5


@pytest.mark.parametrize(
    "args, match",
    [
        (("c", None, 5, "free"), "only 0 are attached"),
        (("c", None, 5, "sideways"), "direction"),
        (("c", None, -1, "h2d"), "nbytes"),
    ],
)
def test_invalid_records_raise(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TransferLedger().record(*args)


def test_listener_and_metrics_sink() -> None:
    led = TransferLedger()
    seen: list[Move] = []
    remove = led.add_listener(seen.append)

    class Sink:
        def __init__(self) -> None:
            self.transfers: list[tuple] = []
            self.device: list[tuple] = []

        def record_transfer(self, component: str, direction: str, nbytes: int, seconds: float) -> None:
            self.transfers.append((component, direction, nbytes, seconds))

        def set_device_bytes(self, component: str, now: int, peak: int) -> None:
            self.device.append((component, now, peak))

    sink = Sink()
    led.forward_to(sink)
    led.record("vae", None, 7, "h2d", 0.25)
    led.record("vae", None, 7, "free", 0.0)
    remove()
    led.record("vae", None, 3, "h2d")
    assert [m.nbytes for m in seen] == [7, 7]
    assert sink.transfers == [("vae", "h2d", 7, 0.25), ("vae", "free", 7, 0.0), ("vae", "h2d", 3, 0.0)]
    assert sink.device == [("vae", 7, 7), ("vae", 0, 7), ("vae", 3, 7)]


def test_failing_listener_does_not_break_recording() -> None:
    led = TransferLedger()

    def boom(move: Move) -> None:
        raise RuntimeError("metrics down")

    led.add_listener(boom)
    led.record("c", None, 1, "h2d")
    assert led.device_bytes() == 1


def test_concurrent_records_keep_exact_totals() -> None:
    led = TransferLedger()

    def work(k: int) -> None:
        for i in range(500):
            led.record(f"c{k}", f"l{i % 3}", 8, "h2d")
            led.record(f"c{k}", f"l{i % 3}", 8, "free")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert led.device_bytes() == 0
    assert all(led.totals()[f"c{k}"] == {"h2d": 4000, "free": 4000} for k in range(4))
    seqs = [m.seq for m in led.moves()]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4000
    # Peak is at least one move and at most every thread holding one move at once.
    assert 8 <= led.peak_bytes() <= 32


def test_check_against_cuda_needs_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("covered by the CUDA device checks")
    with pytest.raises(RuntimeError, match="CUDA"):
        TransferLedger().check_against_cuda()
