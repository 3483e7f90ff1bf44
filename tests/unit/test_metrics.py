"""Batching log lines (parsed back with regexes) and the Prometheus exposition (parsed with prometheus_client)."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffuserve.engine.metrics import BatchingStats, EngineMetrics, format_dispatch, format_stats, summarize
from diffuserve.engine.request import Request
from diffuserve.engine.scheduler import BatchingConfig, Dispatch, RequestLevelScheduler, ScheduledBatch
from diffuserve.sampling import SamplingParams
from tests.conftest import log_messages

DISPATCH_RE = re.compile(
    r"^Dynamic batch dispatch: size=(\d+)/(\d+), user_max=(\d+), queue_wait=(\d+\.\d{2})ms, stop_reason=(\S+)$"
)
STATS_RE = re.compile(
    r"^Dynamic batch stats \(last (\d+) dispatches\): avg_size=(\d+\.\d{2}), merged_rate=(\d+\.\d)%, "
    r"full_rate=(\d+\.\d)%, utilization=(\d+\.\d)%, wait_avg=(\d+\.\d{2})ms, wait_p95=(\d+\.\d{2})ms, "
    r"top_rejects=(\S+)$"
)


def batch(
    ns: list[int], cap: int, wait_ms: float, reason: str, rejects: dict[str, int] | None = None, user_max: int = 8
) -> ScheduledBatch:
    requests = [Request(f"r{i}", SamplingParams(prompt="p", n=n), arrival_time=0.0) for i, n in enumerate(ns)]
    return ScheduledBatch(
        requests=requests,
        effective_cap=cap,
        user_max=user_max,
        num_outputs=sum(ns),
        stop_reason=reason,
        head_queue_wait_s=wait_ms / 1000,
        rejects=rejects or {},
    )


# Five hand-made dispatches; the expected figures below are worked out by hand in the comments.
WINDOW = [
    batch([1, 1], 8, 1.0, "delay", {"sampling_params.width": 2}),  # rows 2, merged
    batch([1, 1, 1, 1], 4, 2.0, "config_cap:4", {"batch_full": 1}),  # rows 4, merged, full
    batch([1], 8, 3.0, "delay", {"sampling_params.width": 1, "image_conditioning": 1}),  # rows 1
    batch([6], 4, 4.0, "max_size", user_max=4),  # oversized: full, capacity 6
    batch([1, 2], 8, 10.0, "delay", {"model": 1}),  # rows 3, merged
]
# rows 16 / 5 = 3.20; merged 3/5 = 60.0%; full 2/5 = 40.0%; capacity 8+4+8+6+8 = 34, 16/34 = 47.1%;
# waits 1,2,3,4,10 -> avg 4.00ms, nearest-rank p95 = rank ceil(4.75) = 5 -> 10.00ms.
EXPECTED_TOP = "sampling_params.width=3,batch_full=1,image_conditioning=1,model=1"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return log_messages(caplog, logger="diffuserve.batching")


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_dispatch_and_stats_lines_match_hand_computed_values() -> None:
    """The lines' text from the window's figures (that `record` logs them: the two tests below)."""
    stats = BatchingStats(EngineMetrics(), log_enabled=False)
    for b in WINDOW:
        stats.record(b)
    dispatch_lines = [format_dispatch(b) for b in WINDOW]
    # The oversized single request (4th) says how it runs instead of `size=6/4` (issue 22 item 7).
    assert dispatch_lines[3] == (
        "Dynamic batch dispatch: requests=1, rows=6 in 2 calls of <= 4 rows, user_max=4, "
        "queue_wait=4.00ms, stop_reason=max_size"
    )
    parsed = [DISPATCH_RE.match(line) for line in dispatch_lines[:3] + dispatch_lines[4:5]]
    assert all(parsed), dispatch_lines
    assert [m.groups() for m in parsed if m] == [
        ("2", "8", "8", "1.00", "delay"),
        ("4", "8", "8", "2.00", "config_cap:4"),
        ("1", "8", "8", "3.00", "delay"),
        ("3", "8", "8", "10.00", "delay"),
    ]
    assert stats.last_window is not None, "the window of 5 completed"
    stats_line = format_stats(stats.last_window)
    m = STATS_RE.match(stats_line)
    assert m, stats_line
    assert m.groups() == ("5", "3.20", "60.0", "40.0", "47.1", "4.00", "10.00", EXPECTED_TOP)


def test_stats_line_every_window_and_none_rejects(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="diffuserve.batching")
    stats = BatchingStats(None, log_enabled=True, window=5)
    for _ in range(12):
        stats.record(batch([1], 8, 0.04, "config_cap:1"))
    stats_lines = [line for line in lines(caplog) if line.startswith("Dynamic batch stats")]
    assert len(stats_lines) == 2  # after dispatch 5 and 10, not 12
    m = STATS_RE.match(stats_lines[0])
    assert m and m.group(8) == "none" and m.group(3) == "0.0" and m.group(5) == "12.5"


def test_top_rejects_keeps_the_five_commonest() -> None:
    rejects = {"a": 1, "b": 6, "c": 2, "d": 5, "e": 3, "f": 4}
    summary = summarize([batch([1], 8, 1.0, "delay", rejects)])
    assert summary.top_rejects == (("b", 6), ("d", 5), ("f", 4), ("e", 3), ("c", 2))


@pytest.mark.parametrize(("count", "rank"), [(1, 1), (19, 19), (20, 19), (21, 20), (100, 95)])
def test_wait_p95_is_nearest_rank(count: int, rank: int) -> None:
    waits = [batch([1], 8, float(i), "delay") for i in range(count, 0, -1)]  # 1..count ms, reversed
    assert summarize(waits).wait_p95_s == pytest.approx(rank / 1000)


def test_logging_off_still_feeds_prometheus(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="diffuserve.batching")
    metrics = EngineMetrics()
    stats = BatchingStats(metrics, log_enabled=False)
    for b in WINDOW:
        stats.record(b)
    assert lines(caplog) == []
    assert stats.last_window is not None and stats.last_window.avg_size == pytest.approx(3.2)
    got = samples(metrics)
    assert got[("diffuserve_batch_dispatches_total", (("reason", "delay"),))] == 3
    assert got[("diffuserve_batch_dispatches_total", (("reason", "config_cap:4"),))] == 1
    assert got[("diffuserve_batching_rejects_total", (("reason", "sampling_params.width"),))] == 3
    assert got[("diffuserve_batching_rejects_total", (("reason", "model"),))] == 1
    assert got[("diffuserve_batch_size_outputs_count", ())] == 5
    assert got[("diffuserve_batch_size_outputs_sum", ())] == 16
    assert got[("diffuserve_batch_size_outputs_bucket", (("le", "2.0"),))] == 2  # rows 1 and 2
    assert got[("diffuserve_batch_size_requests_sum", ())] == 10
    assert got[("diffuserve_batch_capacity_outputs_total", ())] == 34
    assert got[("diffuserve_batch_merged_dispatches_total", ())] == 3
    assert got[("diffuserve_batch_full_dispatches_total", ())] == 2
    assert got[("diffuserve_batch_head_queue_wait_seconds_sum", ())] == pytest.approx(0.020)


def test_engine_methods_show_up_in_the_exposition() -> None:
    metrics = EngineMetrics()
    other = EngineMetrics()  # own registries: two instances never collide
    metrics.observe_request("images.generations", "success", 0.3)
    metrics.observe_request("images.generations", "success", 0.7)
    metrics.observe_request("images.generations", "rejected")
    metrics.observe_queue_wait(0.002)
    metrics.set_queue_depth(7)
    metrics.set_running(3)
    metrics.observe_stage("denoise", 1.5)
    metrics.add_outputs_generated(4)
    metrics.inc_cancelled_before_run()
    metrics.record_transfer("transformer", "h2d", 1000, 0.25)
    metrics.record_transfer("transformer", "h2d", 500, 0.25)
    metrics.set_device_bytes("transformer", now=100, peak=1500)
    got = samples(metrics)
    ep = ("endpoint", "images.generations")
    assert got[("diffuserve_requests_total", (ep, ("status", "success")))] == 2
    assert got[("diffuserve_requests_total", (ep, ("status", "rejected")))] == 1
    assert got[("diffuserve_request_latency_seconds_count", (ep,))] == 2
    assert got[("diffuserve_request_latency_seconds_sum", (ep,))] == pytest.approx(1.0)
    assert got[("diffuserve_queue_wait_seconds_count", ())] == 1
    assert got[("diffuserve_queue_depth", ())] == 7
    assert got[("diffuserve_running_batch_size", ())] == 3
    assert got[("diffuserve_stage_seconds_sum", (("stage", "denoise"),))] == pytest.approx(1.5)
    assert got[("diffuserve_outputs_generated_total", ())] == 4
    assert got[("diffuserve_requests_cancelled_before_run_total", ())] == 1
    tr = (("component", "transformer"), ("direction", "h2d"))
    assert got[("diffuserve_transfer_bytes_total", tr)] == 1500
    assert got[("diffuserve_transfer_seconds_total", tr)] == pytest.approx(0.5)
    assert got[("diffuserve_device_bytes", (("component", "transformer"),))] == 100
    assert got[("diffuserve_device_peak_bytes", (("component", "transformer"),))] == 1500
    assert ("diffuserve_queue_depth", ()) in samples(other) and samples(other)[("diffuserve_queue_depth", ())] == 0
    assert all(name.startswith("diffuserve_") for name, _ in got)


def test_scheduler_to_log_line_end_to_end(caplog: pytest.LogCaptureFixture) -> None:
    """The issue's integration expectation at unit scale: 4 same-shape requests, max 4 -> size=4/4 max_size."""
    caplog.set_level(logging.INFO, logger="diffuserve.batching")
    b = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=4, delay_ms=1000.0), model_names=["m"])
    for i in range(4):
        b.add(Request(f"r{i}", SamplingParams(prompt=f"p{i}", seed=i), arrival_time=1.0 + i * 0.001))
    decision = b.schedule(1.00512)
    assert isinstance(decision, Dispatch)
    BatchingStats(EngineMetrics(), log_enabled=True).record(decision.batch)
    (line,) = lines(caplog)
    assert line == format_dispatch(decision.batch)
    assert line == "Dynamic batch dispatch: size=4/4, user_max=4, queue_wait=5.12ms, stop_reason=max_size"


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        BatchingStats(None, log_enabled=False, window=0)


def test_serving_overhead_and_pipeline_cpu_are_exported() -> None:
    from diffuserve.runtime.cpu_time import CpuAccount

    account = CpuAccount()
    with account.measure():
        sum(i * i for i in range(200_000))  # some CPU in this thread
    assert account.seconds > 0
    metrics = EngineMetrics()
    metrics.observe_serving_overhead(0.003)
    metrics.observe_serving_overhead(-1.0)  # clamped: a clock step never makes a negative bucket
    text = metrics.render()[0].decode()
    assert "diffuserve_serving_overhead_seconds_count 2.0" in text
    assert 'diffuserve_serving_overhead_seconds_bucket{le="0.005"} 2.0' in text
    assert re.search(r"^diffuserve_pipeline_cpu_seconds [0-9.e+-]+$", text, re.MULTILINE)
    assert "diffuserve_process_cpu_seconds_total" in text
