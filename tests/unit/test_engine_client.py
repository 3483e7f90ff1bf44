"""The pieces of `--api-process separate` that need no process: the channel's messages and the /metrics merge."""

from __future__ import annotations

from multiprocessing.connection import Pipe

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from diffuserve.errors import QueueFullError
from diffuserve.launch import engine_messages as m
from diffuserve.server.engine_client import merge_families


def test_messages_cross_with_their_errors_and_the_model_as_plain_data():
    """The model's description crosses as data (its request rules and encoder table, no callable, no lock: the
    standard pickler), and an admission error keeps its status and hint."""
    from diffuserve.family_spec.request_rules import RequestRules
    from diffuserve.family_spec.text_tokens import EncoderLimit
    from diffuserve.sampling import ModelDescription

    ours, theirs = Pipe()
    rules = RequestRules(family="flux", size_multiple=16, max_width=1024, facts={"controlnets": {"canny": None}})
    t5 = EncoderLimit("text_encoder_2 (T5)", "tokenizer_2", "/ckpt/tokenizer_2", "T5TokenizerFast", 512)
    model = ModelDescription(family="flux", rules=rules, text_encoders=(t5,))
    m.send(ours, m.ModelInfo(model))
    m.send(ours, m.Answer("r1", error=QueueFullError("full", retry_after_s=2.0), admitted=False))
    received = m.receive(theirs).model
    assert received == model and received.rules == rules and received.prompt_tokens is None
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
