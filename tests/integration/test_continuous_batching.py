"""`--batching-mode continuous` over a real server with the official openai client: requests arriving while
others denoise join the running group at a step boundary, every image equals its singleton-server image
(within 1/255), a failing step fails only its rows, cancellation frees a row, /health and drain behave.

Concurrency is gated on the server's own metrics (the running gauge, set at every step, and the step counter), never
on sleeps or log text.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.conftest import FAULT_MARKER, HOLD_MARKER
from tests.integration.helpers import decode_b64_png, metric_value, pixels
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running, seconds_after_running, wait_idle

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255
STEPS = "diffuserve_continuous_step_batch_rows_count"
"""Denoising steps the continuous loop ran (one observation per step, before it runs)."""


def _server(path: Path, logs: Path) -> ServerProcess:
    return ServerProcess(
        [
            "--model-path",
            str(path),
            "--served-model-name",
            "tiny-flux-continuous",
            "--batching-mode",
            "continuous",
            "--batching-max-size",
            "4",
            "--enable-batching-metrics",
            "--max-queue-size",
            "0",
            "--max-inference-steps",
            "5000",
        ],
        logs / "server.log",
        env={
            "DIFFUSERVE_FAULT_INJECTION": f"prompt:{FAULT_MARKER},hold:{HOLD_MARKER},"
            f"{StepHold(logs).env()['DIFFUSERVE_FAULT_INJECTION']}"
        },
    )


def _hold(server: ServerProcess) -> StepHold:
    """Steps of a group with a `StepHold.MARKER` row wait until the test releases them (`tests/step_hold.py`)."""
    return StepHold(server.log_path.parent)


@pytest.fixture(scope="module")
def continuous_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _server(tiny_flux_path, tmp_path_factory.mktemp("continuous")).start()
    yield server
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _generate(server: ServerProcess, prompt: str, seed: int, steps: int, **extra: object) -> np.ndarray:
    result = _client(server).images.generate(
        model="tiny-flux-continuous",
        prompt=prompt,
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": steps, **extra},
    )
    return pixels(decode_b64_png(result.data[0].b64_json))


def _singleton(server: ServerProcess, prompt: str, seed: int, steps: int) -> np.ndarray:
    body = {"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": steps}
    response = httpx.post(f"{server.base_url}/v1/images/generations", timeout=300, json=body)
    return pixels(decode_b64_png(response.json()["data"][0]["b64_json"]))


def _overlap_steps(server: ServerProcess) -> dict[str, float]:
    return {
        stage: metric_value(server.base_url, "diffuserve_overlap_steps_total", {"stage": stage})
        for stage in ("encode", "decode")
    }


def _rows_stepping(server: ServerProcess) -> float:
    """Requests in the group's latest step (the gauge is set at every step; 0 when the loop is idle)."""
    return metric_value(server.base_url, "diffuserve_running_batch_size")


def _until(server: ServerProcess, condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}; log tail:\n{server.log()[-3000:]}"
        time.sleep(0.05)


def _open_anchor(server: ServerProcess, steps: int) -> socket.socket:
    """A long request sent over a raw socket, so the test decides when its client goes away (close()); returns once
    it steps (alone: the server was idle before it)."""
    wait_idle(server)
    body = json.dumps({"prompt": "the anchor", "seed": 99, "size": "64x64", "num_inference_steps": steps}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    _until(server, lambda: running(server), "the anchor stepping")
    return sock


def test_arrivals_join_the_running_group_and_equal_their_singleton_images(continuous_server, singleton_server):
    """A long anchor keeps the group running (gated on the server's metrics), so b and c surely arrive mid-run; they
    join at a step boundary, leave after their own last step while the anchor goes on, and equal their
    singleton-server images. Then the anchor's client disconnects and its row leaves at the next step."""
    server = continuous_server
    anchor = _open_anchor(server, 5000)
    try:
        joins = metric_value(server.base_url, "diffuserve_continuous_joins_total")  # the anchor's join counted
        jobs = [("joins first", 12, 3), ("joins second", 13, 5)]
        with ThreadPoolExecutor(2) as pool:
            second = pool.submit(_generate, server, *jobs[0])
            # A counter, not the gauge: a 3-step joiner may be gone again before a poll would see 2 rows.
            _until(
                server,
                lambda: metric_value(server.base_url, "diffuserve_continuous_joins_total") > joins,
                "the first arrival joining the anchor's group",
            )
            third = pool.submit(_generate, server, *jobs[1])
            got = [second.result(), third.result()]
        # Both left while the anchor kept denoising: a later step has the anchor alone again (the third's last step
        # had the anchor beside it, so the gauge reads 1 only after a step that came after).
        _until(server, lambda: _rows_stepping(server) == 1, "the anchor stepping alone again", timeout_s=60)
    finally:
        anchor.close()  # the anchor's client goes away
    for (prompt, seed, steps), image in zip(jobs, got, strict=True):
        alone = _singleton(singleton_server, prompt, seed, steps)
        assert int(np.abs(image.astype(np.int16) - alone.astype(np.int16)).max()) <= PIXEL_TOL, prompt
    assert metric_value(server.base_url, "diffuserve_continuous_joins_total") >= 3
    assert metric_value(server.base_url, "diffuserve_continuous_leaves_total", {"reason": "finished"}) >= 2
    # The server notices the disconnect and the row is removed at a step boundary (observed by the counter).
    deadline = time.monotonic() + 60
    while metric_value(server.base_url, "diffuserve_continuous_leaves_total", {"reason": "cancelled"}) < 1:
        assert time.monotonic() < deadline, "the disconnected request never left the denoise group"
    assert (
        metric_value(server.base_url, "diffuserve_requests_total", {"endpoint": "images", "status": "cancelled"}) >= 1
    )


def test_a_joiners_encode_and_decode_run_beside_the_stepping_group(continuous_server, singleton_server):
    """The joiner's text encode (encode lane) and its decode (decode lane) each wait, by the `hold:` fault
    injection, until the loop has run two more denoising steps of the anchor: only a loop that did not stop for
    them can run those steps (the loop's own step counter, reported as `overlap_steps_total`). Its image still
    equals its singleton image."""
    server = continuous_server
    before = _overlap_steps(server)
    anchor = _open_anchor(server, 5000)
    try:
        image = _generate(server, f"{HOLD_MARKER} joiner", 21, 3)
    finally:
        anchor.close()
    after = _overlap_steps(server)
    assert after["encode"] - before["encode"] >= 2, "the loop stopped while the joiner's prompt was encoded"
    assert after["decode"] - before["decode"] >= 2, "the loop stopped while the joiner was decoded"
    alone = _singleton(singleton_server, f"{HOLD_MARKER} joiner", 21, 3)
    assert int(np.abs(image.astype(np.int16) - alone.astype(np.int16)).max()) <= PIXEL_TOL


def test_a_row_past_its_deadline_leaves_at_the_next_step(continuous_server):
    """A 5000-step request with a 2 s timeout is removed from the running group (504) and the server serves on.
    Its steps are held until the deadline has passed, so it is still in the group then on any machine."""
    before = metric_value(continuous_server.base_url, "diffuserve_continuous_leaves_total", {"reason": "deadline"})
    hold = _hold(continuous_server)
    hold.arm()
    releaser = hold.release_when(seconds_after_running(continuous_server, 2))
    with pytest.raises(openai.APIStatusError, match="removed from the denoise group") as raised:
        _generate(continuous_server, f"too slow {StepHold.MARKER}", 7, 5000, timeout=2)
    releaser.join(10)
    assert raised.value.status_code == 504
    assert (
        metric_value(continuous_server.base_url, "diffuserve_continuous_leaves_total", {"reason": "deadline"})
        == before + 1
    )
    assert _generate(continuous_server, "after the deadline", 8, 2).shape == (64, 64, 3)


def test_a_failing_step_fails_its_rows_and_the_server_keeps_serving(continuous_server):
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        _generate(continuous_server, f"please {FAULT_MARKER}", 1, 2)
    assert _generate(continuous_server, "after the fault", 2, 2).shape == (64, 64, 3)
    assert httpx.get(f"{continuous_server.base_url}/health").status_code == 200


def test_timings_report_the_rows_of_the_answer(continuous_server):
    """Continuous mode reports `timings.batch_rows` (issue 22 item 5): a request with n=2 steps as two rows."""
    answer = httpx.post(
        f"{continuous_server.base_url}/v1/images/generations",
        timeout=120,
        json={"prompt": "a red circle", "size": "64x64", "n": 2, "num_inference_steps": 2},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["timings"]["batch_rows"] == 2, answer.json()["timings"]


def test_drain_finishes_the_running_group_then_exits(continuous_server):
    """Last test of the module: SIGTERM turns /health 503 and the running row still gets its image. The row's
    steps are held until the server is draining, so it is mid-run at SIGTERM on any machine."""
    server = continuous_server
    hold = _hold(server)
    hold.arm()
    wait_idle(server)
    with ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(_generate, server, f"finish me {StepHold.MARKER}", 5, 60)
            _until(server, lambda: running(server), "the held row stepping")
            server.signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while (health := httpx.get(f"{server.base_url}/health", timeout=10)).status_code != 503:
                assert time.monotonic() < deadline, "SIGTERM never turned /health 503"
                time.sleep(0.05)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            steps_at_sigterm = metric_value(server.base_url, STEPS)
        finally:
            hold.release()
        # Still denoising after SIGTERM: the held step was counted before it ran, so a higher count is a later step.
        _until(server, lambda: metric_value(server.base_url, STEPS) > steps_at_sigterm, "a step after SIGTERM", 60)
        assert held.result().shape == (64, 64, 3)
    assert server.proc is not None and server.proc.wait(60) == 0
