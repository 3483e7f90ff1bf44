"""The foundation contract over a real server process: OpenAI images API, probes, errors, metrics."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.integration.helpers import decode_b64_png, metric_value, pixels, stopped_batches, wait_batch_stopped
from tests.step_hold import StepHold, running, wait_idle


@pytest.fixture(scope="module")
def client(singleton_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{singleton_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_readiness_contract_observed_across_warmup(singleton_server):
    seen = singleton_server.startup
    not_ready = [o for o in seen if o.liveness == 200 and o.health == 503]
    assert not_ready, f"never saw liveness 200 with health 503 during start-up: {seen[:5]}"
    # A generation request before ready is refused with 503 (not a hang).
    assert all(o.generation == 503 for o in not_ready if o.generation is not None)
    assert seen[-1].health == 200
    assert httpx.get(f"{singleton_server.base_url}/health").status_code == 200
    assert "warm-up generation" in singleton_server.log()


def test_openai_client_b64(client):
    result = client.images.generate(
        model="tiny-flux",
        prompt="a red fox",
        n=2,
        size="64x64",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 7},
    )
    assert len(result.data) == 2
    images = [decode_b64_png(d.b64_json) for d in result.data]
    assert all(im.size == (64, 64) and im.format == "PNG" for im in images)
    # Two rows of one request draw different noise.
    assert (pixels(images[0]) != pixels(images[1])).any()
    extra = result.model_extra or {}
    assert extra["model"] == "tiny-flux" and extra["timings"]["batch_size"] == 1


def test_openai_client_url_and_formats(client, singleton_server):
    result = client.images.generate(
        prompt="a blue car",
        n=2,
        size="32x48",
        response_format="url",
        extra_body={"num_inference_steps": 2, "output_format": "jpeg", "seed": 3},
    )
    assert len(result.data) == 2
    for item in result.data:
        assert item.url.startswith(singleton_server.base_url)
        response = httpx.get(item.url)
        assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
        image = Image.open(io.BytesIO(response.content))
        assert image.format == "JPEG" and image.size == (32, 48)
    missing = httpx.get(f"{singleton_server.base_url}/v1/images/nope/content")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_webp_and_seed_determinism(singleton_server):
    body = {"prompt": "a green tree", "size": "64x64", "num_inference_steps": 2, "seed": 11}
    first = httpx.post(f"{singleton_server.base_url}/v1/images/generations", json=body, timeout=60).json()
    again = httpx.post(f"{singleton_server.base_url}/v1/images/generations", json=body, timeout=60).json()
    other = httpx.post(
        f"{singleton_server.base_url}/v1/images/generations", json={**body, "seed": 12}, timeout=60
    ).json()
    assert first["seed"] == 11
    a, b, c = (pixels(decode_b64_png(r["data"][0]["b64_json"])) for r in (first, again, other))
    assert (a == b).all()
    assert (a != c).any()
    webp = httpx.post(
        f"{singleton_server.base_url}/v1/images/generations", json={**body, "output_format": "webp"}, timeout=60
    ).json()
    assert decode_b64_png(webp["data"][0]["b64_json"]).format == "WEBP"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "size": "7x7"}, "size"),
        ({"prompt": "x", "size": "0x0"}, "size"),
        ({"prompt": "x", "size": "99999x99999"}, "size"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 11}, "n"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "num_inference_steps": 100000}, "num_inference_steps"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x" * 1_000_000}, "prompt"),
        ({"prompt": "x", "surprise": 1}, "surprise"),
        ({"prompt": "x", "response_format": "gif"}, "response_format"),
        ({}, "prompt"),
    ],
)
def test_bad_requests_get_400_envelopes(singleton_server, body, param):
    response = httpx.post(f"{singleton_server.base_url}/v1/images/generations", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_invalid_json_and_content_type(singleton_server):
    url = f"{singleton_server.base_url}/v1/images/generations"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] == "body"
    form = httpx.post(url, content=b"prompt=x", headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 400 and form.json()["error"]["param"] == "body"


def test_unknown_route_and_models(singleton_server):
    base = singleton_server.base_url
    missing = httpx.get(f"{base}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-flux"]
    assert httpx.get(f"{base}/v1/models/tiny-flux").json()["id"] == "tiny-flux"
    nope = httpx.get(f"{base}/v1/models/other")
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "model_not_found"
    info = httpx.get(f"{base}/server_info").json()
    assert info["served_model_name"] == "tiny-flux" and info["model_id"] == "FLUX.1-dev"
    assert info["pipeline"]["family"] == "flux"
    # The engine's status (engine/status.py) fills the same fields as before it existed.
    assert info["state"] == "ready" and info["queue"]["queued"] == 0 and info["defaults"]["width"] > 0
    assert [r["replica"] for r in info["replicas"]] == [0] and info["distributed"] is None
    # The results store in use (issue 34): the default, SQLite + files under --output-dir; the start-up line names it.
    outputs = singleton_server.log_path.parent / "outputs"
    assert info["results_store"] == {
        "metadata": {"kind": "sqlite", "path": str(outputs / "results.db")},
        "media": {"kind": "files", "path": str(outputs / "media")},
    }
    assert f"results store: metadata in SQLite {outputs / 'results.db'}; files in folder {outputs / 'media'}" in (
        singleton_server.log()
    )


def test_metrics_are_prometheus_text(singleton_server, client):
    before = metric_value(singleton_server.base_url, "diffuserve_requests_total", {"status": "success"})
    client.images.generate(prompt="metrics", size="32x32", extra_body={"num_inference_steps": 1})
    after = metric_value(singleton_server.base_url, "diffuserve_requests_total", {"status": "success"})
    assert after == before + 1
    assert metric_value(singleton_server.base_url, "diffuserve_stage_seconds_count") > 0
    assert metric_value(singleton_server.base_url, "diffuserve_request_latency_seconds_count") >= 1
    assert metric_value(singleton_server.base_url, "diffuserve_process_resident_memory_bytes") > 50 * 2**20


def _send_and_drop(base_url: str, body: dict, until: Callable[[], bool]) -> None:
    """Send a request over a raw socket and close it once `until()` holds (a client that goes away)."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = httpx.Request("POST", f"{base_url}/v1/images/generations", json=body)
    raw = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload.content)}\r\n\r\n"
    ).encode() + payload.content
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(raw)
        _wait(until)


def _wait(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        time.sleep(0.05)


def test_disconnects_queued_never_runs_running_stops(singleton_server):
    base = singleton_server.base_url
    stopped = stopped_batches(base)
    cancelled_before = metric_value(base, "diffuserve_requests_cancelled_before_run_total")
    cancelled = metric_value(base, "diffuserve_requests_total", {"status": "cancelled"})
    # A long request occupies the worker (held at its first step until both clients are gone, so it is still
    # running then on any machine); a second one queues behind it and its client leaves.
    import threading

    hold = StepHold(singleton_server.log_path.parent)
    hold.arm()
    wait_idle(singleton_server)
    runner_gone = threading.Event()
    long_body = {"prompt": f"long {StepHold.MARKER}", "size": "512x512", "num_inference_steps": 200, "seed": 1}
    runner = threading.Thread(target=_send_and_drop, args=(base, long_body, runner_gone.is_set))
    runner.start()
    try:
        _wait(lambda: running(singleton_server))
        _send_and_drop(
            base,
            {"prompt": "queued then gone", "size": "64x64", "num_inference_steps": 2},
            lambda: metric_value(base, "diffuserve_queue_depth") == 1,
        )
        runner_gone.set()
        runner.join()
        # Both clients' disconnects were seen (the queued one removed, the running one cancelled): now the held
        # step may end, and the batch stops at the next step boundary.
        _wait(lambda: metric_value(base, "diffuserve_requests_total", {"status": "cancelled"}) >= cancelled + 2)
    finally:
        runner_gone.set()
        hold.release()
    assert wait_batch_stopped(base, stopped) < 200, "the batch stopped before its last step"
    deadline = time.monotonic() + 10
    while metric_value(base, "diffuserve_requests_cancelled_before_run_total") < cancelled_before + 1:
        assert time.monotonic() < deadline, "the queued request was not removed"
        time.sleep(0.1)
    # The server still serves.
    ok = httpx.post(
        f"{base}/v1/images/generations", json={"prompt": "after", "size": "32x32", "num_inference_steps": 1}, timeout=60
    )
    assert ok.status_code == 200


def test_generate_cli_writes_files(tiny_flux_path: Path, tmp_path: Path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "generate",
            "--model-path",
            str(tiny_flux_path),
            "--prompt",
            "a cat",
            "--prompt",
            "a dog",
            "--num-outputs-per-prompt",
            "2",
            "--width",
            "32",
            "--height",
            "32",
            "--num-inference-steps",
            "2",
            "--output-path",
            str(tmp_path / "out"),
            "--output-file-name",
            "pic",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    paths = [Path(line) for line in out.stdout.split() if line.endswith(".png")]
    assert len(paths) == 4
    for path in paths:
        assert Image.open(path).size == (32, 32)
    assert "step" in out.stderr  # tqdm progress over denoising steps
