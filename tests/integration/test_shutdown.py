"""Graceful shutdown: SIGTERM drains accepted requests, /health turns 503, exit code 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from tests.serverproc import ServerProcess
from tests.step_hold import StepHold


def _fire(base_url: str, count: int, body: dict) -> tuple[list[threading.Thread], list[httpx.Response]]:
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        response = httpx.post(f"{base_url}/v1/images/generations", json={**body, "seed": i}, timeout=120)
        with lock:
            answers.append(response)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, answers


def _wait_accepted(base_url: str, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{base_url}/metrics").text
        queued = running = 0.0
        for line in text.splitlines():
            if line.startswith("diffuserve_queue_depth "):
                queued = float(line.split()[1])
            if line.startswith("diffuserve_running_batch_size "):
                running = float(line.split()[1])
        done = sum(
            float(line.split()[1]) for line in text.splitlines() if line.startswith("diffuserve_requests_total{")
        )
        if queued + running + done >= count:
            return
        time.sleep(0.02)
    raise AssertionError("requests were not all accepted")


def test_sigterm_with_16_in_flight(tiny_flux_path: Path, tmp_path: Path):
    server = ServerProcess(["--model-path", str(tiny_flux_path), "--shutdown-timeout-s", "120"], tmp_path / "log")
    server.start()
    threads, answers = _fire(server.base_url, 16, {"prompt": "drain me", "size": "64x64", "num_inference_steps": 40})
    _wait_accepted(server.base_url, 16)
    server.signal(signal.SIGTERM)
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    late = httpx.post(f"{server.base_url}/v1/images/generations", json={"prompt": "too late"}, timeout=30)
    assert late.status_code == 503
    for thread in threads:
        thread.join(120)
    assert sorted(r.status_code for r in answers) == [200] * 16
    assert server.proc.wait(60) == 0
    server.stop()


def test_shutdown_timeout_answers_the_rest_with_errors(tiny_flux_path: Path, tmp_path: Path):
    hold = StepHold(tmp_path)  # the running request is held at its first step: none finishes within 0.5 s
    hold.arm()
    server = ServerProcess(
        ["--model-path", str(tiny_flux_path), "--shutdown-timeout-s", "0.5"], tmp_path / "log", env=hold.env()
    )
    server.start()
    threads, answers = _fire(
        server.base_url, 4, {"prompt": f"too slow {StepHold.MARKER}", "size": "512x512", "num_inference_steps": 200}
    )
    _wait_accepted(server.base_url, 4)
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    hold.release()  # all answered: the cancelled batch may now stop at its next step
    assert len(answers) == 4
    assert all(r.status_code == 503 and "shut down" in r.json()["error"]["message"] for r in answers)
    assert server.proc.wait(60) == 0
    assert time.monotonic() - started < 30
    server.stop()
