"""Small helpers shared by the integration tests."""

from __future__ import annotations

import base64
import io
import re
import time

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
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def wait_for_log(server, pattern: str, *, start: int = 0, timeout_s: float = 20) -> re.Match:
    """Wait until the server log (from offset `start`) matches `pattern`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, server.log()[start:])
        if match:
            return match
        time.sleep(0.05)
    raise AssertionError(f"log never matched {pattern!r}; tail:\n{server.log()[start:][-3000:]}")


def wait_draining(base_url: str, timeout_s: float = 60) -> httpx.Response:
    """Until /health (a public probe) answers 503: the drain has begun. Returns that answer."""
    deadline = time.monotonic() + timeout_s
    while (health := httpx.get(f"{base_url}/health", timeout=10)).status_code != 503:
        assert time.monotonic() < deadline, "the drain never turned /health 503"
        time.sleep(0.05)
    return health
