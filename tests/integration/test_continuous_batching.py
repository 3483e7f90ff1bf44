"""`--batching-mode continuous` over a real server with the official openai client: requests arriving while
others denoise join the running group at a step boundary, every image equals its singleton-server image
(within 1/255), a failing step fails only its rows, cancellation frees a row, /health and drain behave.

Concurrency is gated on the server's own per-step log lines (`--enable-batching-metrics`), never on sleeps.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.conftest import FAULT_MARKER
from tests.integration.helpers import decode_b64_png, metric_value, pixels, wait_for_log
from tests.serverproc import ServerProcess

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255
STEP_RE = r"Continuous denoising step batch: size=(\d+)/(\d+), joined=(\d+), left=(\d+), active=(\d+)"


def _server(path: Path, logs: Path) -> ServerProcess:
    return ServerProcess(
        ["--model-path", str(path), "--served-model-name", "tiny-flux-continuous", "--batching-mode", "continuous",
         "--batching-max-size", "4", "--enable-batching-metrics", "--max-queue-size", "0",
         "--max-inference-steps", "5000"],
        logs / "server.log", env={"DIFFUSERVE_FAULT_INJECTION": f"prompt:{FAULT_MARKER}"})


@pytest.fixture(scope="module")
def continuous_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _server(tiny_flux_path, tmp_path_factory.mktemp("continuous")).start()
    yield server
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _generate(server: ServerProcess, prompt: str, seed: int, steps: int) -> np.ndarray:
    result = _client(server).images.generate(
        model="tiny-flux-continuous", prompt=prompt, size="64x64", response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": steps})
    return pixels(decode_b64_png(result.data[0].b64_json))


def test_arrivals_join_the_running_group_and_equal_their_singleton_images(continuous_server, singleton_server):
    server = continuous_server
    start = len(server.log())
    jobs = [("a long one", 11, 12), ("joins later", 12, 3), ("joins last", 13, 5)]
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_generate, server, *jobs[0])
        wait_for_log(server, STEP_RE.replace(r"active=(\d+)", "active=1"), start=start, timeout_s=120)
        second = pool.submit(_generate, server, *jobs[1])
        # b joined a running group: a step line with joined=1 and both active
        joined = wait_for_log(server, r"Continuous denoising step batch: size=2/4, joined=1, left=0, active=2",
                              start=start, timeout_s=120)
        third = pool.submit(_generate, server, *jobs[2])
        got = [first.result(), second.result(), third.result()]
    assert joined
    lines = re.findall(STEP_RE, server.log()[start:])
    assert any(int(left) >= 1 for *_, left, _ in lines), "no row ever left while others kept denoising"
    for (prompt, seed, steps), image in zip(jobs, got, strict=True):
        alone = pixels(decode_b64_png(httpx.post(
            f"{singleton_server.base_url}/v1/images/generations", timeout=300,
            json={"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": steps}).json()["data"][0]["b64_json"]))
        assert int(np.abs(image.astype(np.int16) - alone.astype(np.int16)).max()) <= PIXEL_TOL, prompt
    assert metric_value(server.base_url, "diffuserve_continuous_joins_total") >= 3
    assert metric_value(server.base_url, "diffuserve_continuous_leaves_total", {"reason": "finished"}) >= 3


def test_a_failing_step_fails_its_rows_and_the_server_keeps_serving(continuous_server):
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        _generate(continuous_server, f"please {FAULT_MARKER}", 1, 2)
    assert _generate(continuous_server, "after the fault", 2, 2).shape == (64, 64, 3)
    assert httpx.get(f"{continuous_server.base_url}/health").status_code == 200


def test_a_disconnected_client_leaves_the_group_at_the_next_step(continuous_server):
    server = continuous_server
    start = len(server.log())
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(1) as pool:
        keep = pool.submit(_generate, server, "stays", 21, 6)
        wait_for_log(server, STEP_RE, start=start, timeout_s=120)
        with pytest.raises(httpx.ReadTimeout):  # this client goes away while its 2000-step request denoises
            client.post(f"{server.base_url}/v1/images/generations", timeout=httpx.Timeout(300, read=0.5),
                        json={"prompt": "goes away", "seed": 22, "size": "64x64", "num_inference_steps": 2000})
        assert keep.result().shape == (64, 64, 3)
    # The server notices the disconnect and the row is removed at a step boundary (observed by the counter).
    deadline = time.monotonic() + 60
    while metric_value(server.base_url, "diffuserve_continuous_leaves_total", {"reason": "cancelled"}) < 1:
        assert time.monotonic() < deadline, "the disconnected request never left the denoise group"
    assert metric_value(server.base_url, "diffuserve_requests_total",
                        {"endpoint": "images", "status": "cancelled"}) >= 1


def test_drain_finishes_the_running_group_then_exits(continuous_server):
    """Last test of the module: SIGTERM turns /health 503 and the running row still gets its image."""
    server = continuous_server
    start = len(server.log())
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate, server, "finish me", 5, 60)
        wait_for_log(server, STEP_RE, start=start, timeout_s=120)
        server.signal(signal.SIGTERM)
        wait_for_log(server, STEP_RE, start=len(server.log()), timeout_s=60)  # still denoising after SIGTERM
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert running.result().shape == (64, 64, 3)
    assert server.proc is not None and server.proc.wait(60) == 0
