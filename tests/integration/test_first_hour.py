"""What a new user hits in the first hour, against real servers and the real CLI: HTTP details (auth
scheme, HEAD probes, trailing slashes, /docs behind the key), error answers on /metrics, edit upload
messages, the row cap as a hard cap, prompt truncation warnings, the second shutdown signal, exit
codes of broken checkpoints, Ctrl-C in `generate` and flags that do not apply to the model."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.integration.helpers import decode_b64_png, metric_value, pixels, wait_draining
from tests.serverproc import ServerProcess, free_port

KEY = "first-hour-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_PROMPT = " ".join(["a small red fox sitting in fresh snow at golden hour"] * 12)


@pytest.fixture(scope="module")
def server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """API key, dynamic batching capped at 2 rows, small limits for the 413, pixel-limit and 429 checks.
    The last test of the module shuts it down."""
    logs = tmp_path_factory.mktemp("first-hour")
    proc = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--api-key",
            KEY,
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "2",
            "--max-image-side",
            "256",
            "--max-request-bytes",
            "65536",
            "--max-inference-steps",
            "100000",
            "--warmup-steps",
            "1",
            "--max-queue-size",
            "2",
        ],
        logs / "server.log",
    )
    proc.start(headers=AUTH)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def _errors(server: ServerProcess) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        (s.labels["status"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "diffuserve_error_responses_total"
    }


def test_http_details_and_error_counts(server: ServerProcess, client: openai.OpenAI):
    base = server.base_url
    body = {"prompt": "slash", "size": "32x32", "num_inference_steps": 1}
    # The auth scheme is case-insensitive; a wrong key or scheme is still 401.
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"BEARER  {KEY}"}).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    # /docs and /openapi.json need the key like the API (the README says so).
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    assert httpx.get(f"{base}/openapi.json", headers=AUTH).status_code == 200
    assert httpx.get(f"{base}/docs", headers=AUTH).status_code == 200
    # HEAD on the probes (no key needed).
    assert httpx.head(f"{base}/health").status_code == 200 and httpx.head(f"{base}/liveness").status_code == 200
    # A trailing slash on a POST route is served (no 307 that makes clients drop the body).
    slash = httpx.post(f"{base}/v1/images/generations/", json=body, headers=AUTH, timeout=120)
    assert slash.status_code == 200, slash.text
    assert httpx.head(f"{base}/health/").status_code == 200

    before = _errors(server)
    assert httpx.post(f"{base}/v1/images/generations", json={"prompt": ""}, headers=AUTH).status_code == 400
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/v1/nothing", headers=AUTH).status_code == 404
    big = httpx.post(
        f"{base}/v1/images/generations", content=b"x" * 70000, headers={**AUTH, "content-type": "application/json"}
    )
    assert big.status_code == 413
    # Unknown model: 404 model_not_found, as OpenAI answers (and the README's error table says).
    with pytest.raises(openai.NotFoundError) as missing:
        client.images.generate(prompt="x", model="no-such-model", size="32x32")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    late = httpx.post(
        f"{base}/v1/images/generations",
        headers=AUTH,
        timeout=120,
        json={"prompt": "slow", "size": "32x32", "num_inference_steps": 50000, "timeout": 0.5},
    )
    assert late.status_code == 504
    after = _errors(server)
    grew = {key: after.get(key, 0) - before.get(key, 0) for key in after if after.get(key, 0) > before.get(key, 0)}
    assert grew == {
        ("400", "invalid_value"): 1,
        ("401", "invalid_api_key"): 1,
        ("404", "not_found"): 1,
        ("413", "request_too_large"): 1,
        ("404", "model_not_found"): 1,
        ("504", "timeout"): 1,
    }


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def test_edit_upload_messages(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as not_image:
        client.images.edit(image=("notes.txt", b"just some text", "text/plain"), prompt="x", size="32x32")
    assert not_image.value.body["message"] == "image: not a PNG, JPEG, WebP, GIF or BMP file"
    assert not_image.value.body["param"] == "image"
    with pytest.raises(openai.BadRequestError) as too_big:
        client.images.edit(image=("big.png", _png(300, 300), "image/png"), prompt="x", size="32x32")
    assert "--max-image-side 256" in too_big.value.body["message"]


def test_batching_max_size_is_a_hard_cap_on_rows(server: ServerProcess, client: openai.OpenAI):
    """n=5 under a cap of 2 runs as calls of 2, 2 and 1 rows; each row keeps seed + j, so its image is
    exactly the image of the same seed in a call of the same rows (tolerance 0)."""
    extra = {"num_inference_steps": 2, "seed": 11}
    big = client.images.generate(prompt="capped", n=5, size="32x32", response_format="b64_json", extra_body=extra)
    timings = big.model_extra["timings"]
    # The answer tells it: one request, calls of at most 2 rows, 3 pipeline calls.
    assert (timings["batch_rows"], timings["batch_requests"], timings["pipeline_calls"]) == (2, 1, 3)
    parts = [
        client.images.generate(
            prompt="capped",
            n=n,
            size="32x32",
            response_format="b64_json",
            extra_body={"num_inference_steps": 2, "seed": seed},
        )
        for n, seed in ((2, 11), (2, 13), (1, 15))
    ]
    reference = [pixels(decode_b64_png(d.b64_json)) for part in parts for d in part.data]
    got = [pixels(decode_b64_png(d.b64_json)) for d in big.data]
    assert len(got) == 5
    for a, b in zip(got, reference, strict=True):
        assert np.array_equal(a, b)
    assert parts[0].model_extra["timings"]["batch_rows"] == 2


def test_long_prompt_warns_naming_the_encoders(server: ServerProcess, client: openai.OpenAI):
    start = len(server.log())
    result = client.images.generate(prompt=LONG_PROMPT, size="32x32", extra_body={"num_inference_steps": 1})
    warnings = result.model_extra["warnings"]
    assert len(warnings) == 2
    assert warnings[0].startswith("prompt is ") and "tokens for text_encoder (CLIP), which takes 77" in warnings[0]
    assert "tokens for text_encoder_2 (T5), which takes 64" in warnings[1]
    short = client.images.generate(prompt="a fox", size="32x32", extra_body={"num_inference_steps": 1})
    assert short.model_extra["warnings"] == []
    assert server.log()[start:].count("request truncated by the text encoders") == 1


# -- helpers of the shutdown test ------------------------------------------------------------------------


def _post_in_thread(base: str, body: dict, answers: list) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{base}/v1/images/generations", json=body, headers=AUTH, timeout=120))
    )
    thread.start()
    return thread


def _wait_metric(base: str, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while metric_value(base, name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


# -- the CLI against real checkpoints --------------------------------------------------------------------


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("missing", ["vae", "tokenizer_2"])
def test_a_checkpoint_that_cannot_load_exits_1(tiny_flux_path: Path, tmp_path: Path, missing: str):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_flux_path, broken)
    shutil.rmtree(broken / missing)
    generate = _cli("generate", "--model-path", str(broken), "--prompt", "x", "--output-path", str(tmp_path / "o"))
    assert generate.returncode == 1, generate.stderr[-2000:]
    assert missing in generate.stderr and "Traceback" not in generate.stderr
    if missing == "vae":  # tokenizer_2 under serve: tests/integration/test_startup_failures.py
        serve = _cli("serve", "--model-path", str(broken), "--port", str(free_port()))
        assert serve.returncode == 1 and missing in serve.stderr and "Traceback" not in serve.stderr


def test_flags_that_do_not_apply_to_the_model_are_errors(
    tiny_flux_path: Path, tiny_wan_path: Path, tmp_path: Path, cli_main
):
    image = cli_main(
        "generate",
        "--model-path",
        str(tiny_flux_path),
        "--prompt",
        "x",
        "--num-frames",
        "9",
        "--output-path",
        str(tmp_path),
    )
    assert image.returncode == 2 and "--num-frames" in image.stderr and "makes images" in image.stderr
    video = cli_main(
        "generate",
        "--model-path",
        str(tiny_wan_path),
        "--prompt",
        "x",
        "--output-format",
        "png",
        "--output-path",
        str(tmp_path),
    )
    assert video.returncode == 2 and "--output-format png" in video.stderr and "mp4" in video.stderr
    assert not list(tmp_path.iterdir()), "nothing was generated"


def test_ctrl_c_during_generate_prints_one_line_and_exits_130(tiny_flux_path: Path, tmp_path: Path):
    out_dir = tmp_path / "out"
    # Two prompts in singleton mode: the first call writes its file, the second is interrupted.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "generate",
            "--model-path",
            str(tiny_flux_path),
            "--prompt",
            "quick",
            "--prompt",
            "slow",
            "--width",
            "32",
            "--height",
            "32",
            "--num-inference-steps",
            "200",
            "--output-path",
            str(out_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 180
        while not (out_dir.exists() and any(out_dir.iterdir())):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first prompt never finished"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1
    match = re.search(r"interrupted at step (\d+)/200; wrote 1 files to (.+)$", lines[0])
    assert match and 0 <= int(match.group(1)) < 200 and match.group(2) == str(out_dir), lines[0]
    # The engine finishes the step in flight, then stops: its "stopped at step" line names that step (issue 34).
    stopped = re.search(r"stopped at step (\d+)/200", stderr)
    assert stopped and stopped.group(1) == match.group(1), stderr[-2000:]
    assert [p.name for p in out_dir.iterdir()] == ["quick_0_0.png"]


def test_make_bench_leaves_no_temporary_folder(tmp_path: Path):
    """`make bench` runs benchmarks/bench_pipeline.py, which builds its checkpoint in a temp folder."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_pipeline.py",
            "--runs",
            "2",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--size",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "native / diffusers" in out.stdout
    # torch keeps its own per-user compile cache (torchinductor_<user>) in TMPDIR by design; nothing else stays.
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []


# -- last in the module: it shuts the module's server down ----------------------------------------------


def test_second_signal_answers_in_flight_with_503_and_exits_130(server: ServerProcess):
    base = server.base_url
    body = {"prompt": "never finishes", "size": "32x32", "num_inference_steps": 50000}
    before = _errors(server)
    answers: list[httpx.Response] = []
    threads = [_post_in_thread(base, body, answers)]
    _wait_metric(base, "diffuserve_running_batch_size", 1)
    threads += [_post_in_thread(base, body, answers) for _ in range(2)]
    _wait_metric(base, "diffuserve_queue_depth", 2)
    full = httpx.post(f"{base}/v1/images/generations", json=body, headers=AUTH, timeout=30)
    assert full.status_code == 429  # --max-queue-size 2

    server.signal(signal.SIGTERM)
    health = wait_draining(base)
    assert health.json()["status"] == "draining", health.text
    # /metrics reads the same engine snapshot as /health: draining, with the two queued requests still waiting
    assert metric_value(base, "diffuserve_draining") == 1 and metric_value(base, "diffuserve_queue_depth") == 2
    late = httpx.post(f"{base}/v1/images/generations", json=body, headers=AUTH, timeout=30)
    assert late.status_code == 503
    after = _errors(server)
    for key in (("429", "queue_full"), ("503", "service_unavailable")):
        assert after.get(key, 0) - before.get(key, 0) == 1, key
    assert not answers, "nothing finished before the second signal"

    server.signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert len(answers) == 3
    for answer in answers:
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "service_unavailable"
    assert server.proc.wait(60) == 130
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log
