"""Issue 5 over a real server: auth, body cap, admission control (429), deadlines (504), paths."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.helpers import stopped_batches, wait_batch_stopped
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, seconds_after_running, wait_idle

API_KEY = "test-key-3f9a1c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SLOW = {"prompt": "slow", "size": "512x512", "num_inference_steps": 200, "seed": 1}
"""A long request (200 steps); held at its first step (`HELD`) it stays running however fast the machine is."""
HELD = {"prompt": f"held {StepHold.MARKER}", "size": "64x64", "num_inference_steps": 4, "seed": 1}
"""Runs while the test holds its steps (`tests/step_hold.py`), then finishes quickly."""


@pytest.fixture(scope="module")
def limits_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("limits")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--max-request-bytes",
            "65536",
            "--max-queue-size",
            "2",
            "--max-upload-bytes",
            "200000",
        ],
        logs / "server.log",
        env={"DIFFUSERVE_API_KEY": API_KEY, **StepHold(logs).env()},
    )
    server.start(headers=AUTH)
    yield server
    server.stop()


@pytest.fixture
def hold(limits_server: ServerProcess) -> Iterator[StepHold]:
    """Armed for the test; released at its end whatever happened (so the shared server never stays held)."""
    held = StepHold(limits_server.log_path.parent)
    held.arm()
    wait_idle(limits_server)  # the batch a test then sees running is its own
    yield held
    held.release()


def _post(server: ServerProcess, body: dict, *, headers: dict | None = AUTH, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/images/generations", json=body, headers=headers, timeout=timeout)


def _in_background(server: ServerProcess, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(_post(server, body)))
    thread.start()
    return thread, out


def _wait_metric(server: ServerProcess, line: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
            return
        time.sleep(0.02)
    raise AssertionError(f"/metrics never showed {line!r}")


def _wait_running(server: ServerProcess, timeout_s: float = 20) -> None:
    _wait_metric(server, "diffuserve_running_batch_size 1.0", timeout_s)


def _queued_for(server: ServerProcess, seconds: float):
    """A condition: true `seconds` after a request was first seen queued (a deadline that short has passed)."""
    seen: list[float] = []

    def condition() -> bool:
        if not seen and "diffuserve_queue_depth 1.0" in httpx.get(f"{server.base_url}/metrics").text.splitlines():
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() > seen[0] + seconds

    return condition


def test_api_key_required_except_probes(limits_server):
    base = limits_server.base_url
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = _post(limits_server, {"prompt": "x", "size": "32x32"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=AUTH).status_code == 200
    for path in ("/liveness", "/health", "/metrics"):
        assert httpx.get(f"{base}{path}").status_code == 200
    ok = _post(limits_server, {"prompt": "x", "size": "32x32", "num_inference_steps": 1})
    assert ok.status_code == 200
    assert API_KEY not in limits_server.log()


def test_body_cap_413_before_reading_whole(limits_server):
    big = {"prompt": "x", "negative_prompt": "y" * 100_000}
    response = _post(limits_server, big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap is enforced while streaming
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"z" * 1024
        yield b'"}'

    streamed = httpx.post(
        f"{limits_server.base_url}/v1/images/generations",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=30,
    )
    assert streamed.status_code == 413


def _noise_png(side: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(side, side, 3) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


def test_uploads_have_their_own_cap(limits_server):
    url = f"{limits_server.base_url}/v1/images/edits"
    medium = _noise_png(160)  # over --max-request-bytes, under --max-upload-bytes
    assert 65536 < len(medium) < 200000
    ok = httpx.post(
        url,
        files={"image": ("in.png", medium)},
        headers=AUTH,
        timeout=120,
        data={"prompt": "p", "size": "32x32", "num_inference_steps": "2"},
    )
    assert ok.status_code == 200, ok.text
    too_big = httpx.post(
        url, files={"image": ("in.png", _noise_png(300))}, data={"prompt": "p"}, headers=AUTH, timeout=60
    )
    assert too_big.status_code == 413 and "--max-upload-bytes" in too_big.json()["error"]["message"]


def test_queue_full_gets_429_and_accepted_requests_finish(limits_server, hold):
    runner, first = _in_background(limits_server, HELD)
    _wait_running(limits_server)  # and held there until released below
    queued = [_in_background(limits_server, {**SLOW, "num_inference_steps": 2, "size": "32x32"}) for _ in range(2)]
    _wait_metric(limits_server, "diffuserve_queue_depth 2.0")
    rejected = _post(limits_server, {"prompt": "one too many", "size": "32x32"})
    assert rejected.status_code == 429
    assert rejected.json()["error"]["code"] == "queue_full"
    assert int(rejected.headers["Retry-After"]) >= 1
    hold.release()
    for thread, _ in [(runner, first), *queued]:
        thread.join(60)
    assert [r.status_code for _, out in [(runner, first), *queued] for r in out] == [200, 200, 200]


def test_deadline_queued_and_running_get_504(limits_server, hold):
    stopped = stopped_batches(limits_server.base_url)
    runner, first = _in_background(limits_server, HELD)
    _wait_running(limits_server)  # held until the queued request below has been queued past its deadline
    releaser = hold.release_when(_queued_for(limits_server, 0.3))
    queued = _post(limits_server, {"prompt": "short fuse", "size": "32x32", "timeout": 0.3})
    assert queued.status_code == 504 and queued.json()["error"]["code"] == "timeout"
    assert "queue" in queued.json()["error"]["message"]
    releaser.join(10)
    runner.join(60)
    assert first[0].status_code == 200
    hold.arm()  # the long request is held at its first step until its deadline has passed
    releaser = hold.release_when(seconds_after_running(limits_server, 0.8))
    running = _post(limits_server, {**SLOW, "prompt": f"slow {StepHold.MARKER}", "timeout": 0.8})
    releaser.join(10)
    assert running.status_code == 504
    assert "past its deadline" in running.json()["error"]["message"]
    assert wait_batch_stopped(limits_server.base_url, stopped) < 200, "nobody waits: the batch stopped"


def test_no_field_fetches_urls_and_paths_stay_inside(limits_server, tiny_flux_path: Path, tmp_path: Path, cli_main):
    # There is no field that names a remote resource or a server path: such fields are refused.
    for field in ("image_url", "output_path"):
        response = _post(limits_server, {"prompt": "x", field: "http://169.254.169.254/latest"})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
    out = cli_main(
        "generate",
        "--model-path",
        str(tiny_flux_path),
        "--prompt",
        "x",
        "--output-path",
        str(tmp_path / "out"),
        "--output-file-name",
        "../escape",
    )
    assert out.returncode == 2 and "--output-file-name" in out.stderr
    assert not (tmp_path / "escape.png").exists()
