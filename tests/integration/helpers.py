"""Small helpers shared by the integration tests."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families


def decode_b64_png(data: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def metric_value(base_url: str, name: str, labels: dict[str, str] | None = None, headers: dict | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels` (parsed with prometheus_client)."""
    return metric_reading(base_url, headers)(name, labels)


def metric_reading(base_url: str, headers: dict | None = None) -> Callable[..., float]:
    """One scrape of /metrics: a function summing, as `metric_value` does, samples of that same scrape (for figures
    made of several samples, such as histogram buckets, while the server moves on)."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        wanted = (labels or {}).items()
        return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in wanted))

    return value


def wait_draining(base_url: str, timeout_s: float = 60) -> httpx.Response:
    """Until /health (a public probe) answers 503: the drain has begun. Returns that answer."""
    deadline = time.monotonic() + timeout_s
    while (health := httpx.get(f"{base_url}/health", timeout=10)).status_code != 503:
        assert time.monotonic() < deadline, "the drain never turned /health 503"
        time.sleep(0.05)
    return health


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 60) -> None:
    """Poll `condition` until it holds (deadline-bounded); `what` names it in the failure."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened within {timeout_s}s: {what}"
        time.sleep(0.05)


def stopped_batches(base_url: str, headers: dict | None = None) -> tuple[float, float]:
    """(batches that stopped because every request in them was cancelled, the steps they had run), from /metrics
    (`diffuserve_stopped_batch_steps`; the log's "stopped at step k/N")."""
    read = metric_reading(base_url, headers)
    return read("diffuserve_stopped_batch_steps_count"), read("diffuserve_stopped_batch_steps_sum")


def wait_batch_stopped(
    base_url: str, before: tuple[float, float], headers: dict | None = None, timeout_s: float = 60
) -> int:
    """Wait until exactly one more batch than `before` (a `stopped_batches` reading) stopped; the steps it had run."""
    wait_until(lambda: stopped_batches(base_url, headers)[0] > before[0], "a batch stopped", timeout_s)
    count, steps = stopped_batches(base_url, headers)
    assert count == before[0] + 1, f"{count - before[0]:.0f} batches stopped, not one"
    return round(steps - before[1])
