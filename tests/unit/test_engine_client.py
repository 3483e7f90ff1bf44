"""The pieces of `--api-process separate` that need no process: the channel's pickling and the /metrics merge."""

from __future__ import annotations

import threading
from multiprocessing.connection import Pipe

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from diffuserve.errors import QueueFullError
from diffuserve.launch import engine_messages as m
from diffuserve.server.engine_client import merge_families


class _Guarded:
    """An object that guards itself with a lock, as a prompt-token owner does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value = 7


def test_messages_cross_with_their_errors_and_fresh_locks():
    ours, theirs = Pipe()
    guarded = _Guarded()
    guarded.lock.acquire()  # held here: the copy gets its own, free lock
    m.send(ours, m.Reply(3, guarded))
    m.send(ours, m.Answer("r1", error=QueueFullError("full", retry_after_s=2.0), admitted=False))
    reply = m.receive(theirs)
    assert reply.call_id == 3 and reply.value.value == 7 and reply.value.lock.acquire(blocking=False)
    answer = m.receive(theirs)
    assert answer.request_id == "r1" and not answer.admitted
    assert answer.error.http_status == 429 and answer.error.retry_after_s == 2.0


def _registry(requests: int, errors: int, depth: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("x_requests", "answers", ["status"], registry=registry)
    if requests:
        counter.labels(status="success").inc(requests)
    if errors:
        Counter("x_errors", "errors", ["status"], registry=registry).labels(status="400").inc(errors)
    Gauge("x_queue_depth", "queued", registry=registry).set(depth)
    Histogram("x_latency", "latency", buckets=(1.0,), registry=registry).observe(0.5)
    return registry


def test_metrics_of_both_processes_add_up_in_one_exposition():
    from prometheus_client import generate_latest

    front = _registry(requests=0, errors=2, depth=0)
    engine = _registry(requests=5, errors=0, depth=3)
    merged = merge_families(front.collect(), engine.collect())
    registry = CollectorRegistry(auto_describe=False)

    class Fixed:
        def collect(self):
            return merged

    registry.register(Fixed())  # type: ignore[arg-type]
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert values[("x_requests_total", (("status", "success"),))] == 5
    assert values[("x_errors_total", (("status", "400"),))] == 2
    assert values[("x_queue_depth", ())] == 3
    assert values[("x_latency_count", ())] == 2
    assert values[("x_latency_bucket", (("le", "1.0"),))] == 2
    # Each family once (a duplicate HELP/TYPE line would be an invalid exposition).
    text = generate_latest(registry).decode()
    assert text.count("# TYPE x_requests_total counter") == 1
