"""`serve --api-process separate`: the HTTP front end and the engine core in two processes (issue 24 item 3).

Real servers on real ports, the official `openai` client. What the routes promise holds across the split (images,
url results, streaming previews, /metrics with both processes' counters merged), and a crash of either process is a
clean failure, never a hang: the engine's death answers the request in flight with a 500 and the front end exits 1;
the front end's death makes the engine process exit. The rest of the integration suite runs across the split with
`DIFFUSERVE_TEST_API_PROCESS=separate` (tests/serverproc.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.integration.helpers import decode_b64_png, metric_value
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running


def _tiny(tiny_flux_path: Path) -> list[str]:
    return ["--model-path", str(tiny_flux_path), "--served-model-name", "tiny-flux", "--model-id", "FLUX.1-dev"]


def _engine_pid(front_end_pid: int, timeout_s: float = 60) -> int:
    """The engine process: the front end's child running `diffuserve.launch.engine_process` (read from the process
    table; the start-up output names it too, docs/operations.md)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for child in psutil.Process(front_end_pid).children():
            try:
                if "diffuserve.launch.engine_process" in child.cmdline():
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        assert time.monotonic() < deadline, f"process {front_end_pid} started no engine process"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not reaped yet by its parent) is gone too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"


def _wait_gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout_s}s later"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def split_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Dynamic batching with the engine in its own process, steps holdable (the crash test ends it)."""
    logs = tmp_path_factory.mktemp("split")
    hold = StepHold(logs)
    args = [*_tiny(tiny_flux_path), "--batching-mode", "dynamic", "--batching-max-size", "4", "--api-process"]
    server = ServerProcess([*args, "separate"], logs / "server.log", env=hold.env())
    server.start()
    yield server
    hold.release()
    server.stop()


def test_routes_across_the_split(split_server: ServerProcess) -> None:
    """b64 and url images, a streamed generation with previews, and one /metrics over both processes."""
    client = openai.OpenAI(base_url=f"{split_server.base_url}/v1", api_key="unused", max_retries=0)
    image = client.images.generate(
        model="tiny-flux", prompt="a red square", size="64x64", response_format="b64_json", extra_body={"seed": 3}
    )
    assert decode_b64_png(image.data[0].b64_json).size == (64, 64)
    again = client.images.generate(
        model="tiny-flux", prompt="a red square", size="64x64", response_format="b64_json", extra_body={"seed": 3}
    )
    assert again.data[0].b64_json == image.data[0].b64_json  # same seed, same image, whichever process encodes
    linked = client.images.generate(model="tiny-flux", prompt="a blue circle", size="64x64", response_format="url")
    assert httpx.get(linked.data[0].url, timeout=30).content.startswith(b"\x89PNG")
    events = list(
        client.images.generate(
            model="tiny-flux",
            prompt="a green triangle",
            size="64x64",
            stream=True,
            partial_images=2,
            extra_body={"num_inference_steps": 4},
        )
    )
    kinds = [event.type for event in events]
    assert kinds.count("image_generation.partial_image") == 2 and kinds[-1] == "image_generation.completed"
    with pytest.raises(openai.BadRequestError):
        client.images.generate(model="tiny-flux", prompt="odd size", size="64x50")  # the model's own check
    # Answers counted in the engine process, errors and serving overhead in the front end: one exposition.
    url = split_server.base_url
    assert metric_value(url, "diffuserve_requests_total", {"endpoint": "images", "status": "success"}) >= 4
    assert metric_value(url, "diffuserve_error_responses_total", {"status": "400"}) >= 1
    assert metric_value(split_server.base_url, "diffuserve_serving_overhead_seconds_count") >= 3
    assert metric_value(split_server.base_url, "diffuserve_pipeline_cpu_seconds") > 0
    assert httpx.get(f"{split_server.base_url}/server_info", timeout=10).json()["pipeline"]["family"] == "flux"
    # A SIGTERM to the whole control group (systemd) reaches the engine too: signals are the front end's to act on.
    os.kill(_engine_pid(split_server.proc.pid), signal.SIGTERM)
    after = client.images.generate(model="tiny-flux", prompt="still here", size="64x64", response_format="b64_json")
    assert decode_b64_png(after.data[0].b64_json).size == (64, 64)


def test_engine_crash_is_a_clean_failure(split_server: ServerProcess) -> None:
    """SIGKILL the engine process while a request runs: that request gets a 500 and the front end exits 1."""
    hold = StepHold(split_server.log_path.parent)
    hold.arm()
    engine = _engine_pid(split_server.proc.pid)
    answers: list[httpx.Response] = []
    body = {"prompt": f"doomed {StepHold.MARKER}", "size": "64x64", "num_inference_steps": 2}
    poster = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{split_server.base_url}/v1/images/generations", json=body, timeout=120)
        )
    )
    poster.start()
    deadline = time.monotonic() + 60
    while not running(split_server):
        assert time.monotonic() < deadline, split_server.log()[-2000:]
        time.sleep(0.05)
    os.kill(engine, signal.SIGKILL)
    poster.join(60)
    assert answers and answers[0].status_code == 500, answers and answers[0].text
    assert "engine process exited unexpectedly" in answers[0].json()["error"]["message"]
    assert split_server.proc is not None
    assert split_server.proc.wait(60) == 1, "the front end exits 1 with its engine gone"


def test_front_end_death_stops_the_engine(tiny_flux_path: Path, tmp_path: Path) -> None:
    """SIGKILL the front end (here while the model loads): the engine process notices and exits."""
    server = ServerProcess([*_tiny(tiny_flux_path), "--api-process", "separate"], tmp_path / "server.log")
    cmd = [sys.executable, "-m", "diffuserve.cli", "serve", "--port", str(server.port), *server.args]
    cmd += ["--output-dir", str(tmp_path / "outputs")]
    with open(server.log_path, "wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)  # not gated on /health
        try:
            engine = _engine_pid(proc.pid)
            proc.kill()
            proc.wait(30)
            _wait_gone(engine)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
