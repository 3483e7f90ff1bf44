"""`diffuserve plan` (no weights loaded), residency through a real server, and `diffuserve bench`
against a real server."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.integration.conftest import CliRun
from tests.integration.helpers import decode_b64_png, metric_value, pixels
from tests.serverproc import ServerProcess


@pytest.fixture
def plan(cli_main) -> Callable[..., CliRun]:
    """`plan(*args)` -> `diffuserve plan ARGS` in this process (a subprocess per call cost seconds of interpreter
    start each; the one real process below checks what only a process can: torch never imported)."""
    return functools.partial(cli_main, "plan")


def test_plan_json_for_described_hardware(tiny_flux_path: Path, plan):
    out = plan("--model-path", str(tiny_flux_path), "--num-gpus", "2", "--gpu-memory-gib", "40", "--json")
    assert out.returncode == 0, out.stderr
    described = json.loads(out.stdout)
    assert described["num_gpus"] == 2 and described["performance_mode"] == "auto"
    assert described["components"]["transformer"]["mode"] == "component-offload"  # 40 GiB < 45 GiB
    assert described["fsdp"] is False and any("45" in line for line in described["trace"])
    roomy = json.loads(plan("--model-path", str(tiny_flux_path), "--gpu-memory-gib", "80", "--json").stdout)
    assert roomy["components"]["transformer"]["mode"] == "resident"
    # torch is never imported by `plan`: it resolves from JSON and safetensors headers only (a real process).
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from diffuserve.cli import main; main(['plan', '--model-path', sys.argv[1], "
            "'--gpu-memory-gib', '24']); assert 'torch' not in sys.modules, 'torch imported'",
            str(tiny_flux_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert "Why:" in probe.stdout


def test_plan_says_what_the_model_supports_apart_from_the_batching_mode_in_use(tiny_flux_path: Path, plan):
    """Issue 34: "--batching-mode continuous: steps in a shared denoise group" read as the mode in use."""
    default = plan("--model-path", str(tiny_flux_path)).stdout
    assert "continuous batching supported (steps in a shared denoise group)" in default, default
    assert "--batching-mode continuous:" not in default
    assert "batching: --batching-mode singleton in use (the default" in default, default
    dynamic = plan("--model-path", str(tiny_flux_path), "--batching-mode", "dynamic").stdout
    assert "batching: --batching-mode dynamic in use" in dynamic, dynamic
    diffusers = plan("--model-path", str(tiny_flux_path), "--backend", "diffusers").stdout
    assert "continuous batching not supported" in diffusers, diffusers


def test_plan_errors_name_the_flag(tiny_flux_path: Path, plan):
    out = plan("--model-path", str(tiny_flux_path), "--component-residency", "dit=layerwise-offlaod")
    assert out.returncode == 2 and "--component-residency" in out.stderr


@pytest.fixture(scope="module")
def offload_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("offload")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--component-residency",
            "dit=layerwise-offload",
            "text_encoder=component-offload",
            "vae=snapshot-offload",
            "--dit-offload-prefetch-size",
            "2",
        ],
        logs / "server.log",
    )
    server.start()
    yield server
    server.stop()


def test_offloaded_server_matches_resident_and_reports_transfers(offload_server, singleton_server):
    body = {"prompt": "offloaded fox", "size": "64x64", "num_inference_steps": 3, "seed": 21}
    moved_before = metric_value(
        offload_server.base_url, "diffuserve_transfer_bytes_total", {"component": "transformer"}
    )
    offloaded = httpx.post(f"{offload_server.base_url}/v1/images/generations", json=body, timeout=120).json()
    resident = httpx.post(f"{singleton_server.base_url}/v1/images/generations", json=body, timeout=120).json()
    a, b = (pixels(decode_b64_png(r["data"][0]["b64_json"])) for r in (offloaded, resident))
    assert np.abs(a - b).max() <= 1
    moved = (
        metric_value(offload_server.base_url, "diffuserve_transfer_bytes_total", {"component": "transformer"})
        - moved_before
    )
    assert moved > 0
    assert metric_value(offload_server.base_url, "diffuserve_device_peak_bytes", {"component": "transformer"}) > 0
    served = httpx.get(f"{offload_server.base_url}/server_info", timeout=30).json()["deployment_plan"]["components"]
    assert (served["transformer"]["mode"], served["transformer"]["prefetch_size"]) == ("layerwise-offload", 2)


def test_bench_against_the_real_server(dynamic_server, tmp_path: Path):
    out_json = tmp_path / "run.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "bench",
            "--base-url",
            dynamic_server.base_url,
            "--num-requests",
            "8",
            "--concurrency",
            "1,4",
            "--size",
            "32x32",
            "--steps",
            "1",
            "--label",
            "dyn",
            "--output-json",
            str(out_json),
            "--plot",
            str(tmp_path / "plot.png"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads(out_json.read_text())
    assert run["label"] == "dyn" and [r["concurrency"] for r in run["results"]] == [1, 4]
    for result in run["results"]:
        assert result["completed"] == 8 and result["failed"] == 0
        assert result["latency_ms"]["p50"] > 0 and result["queue_wait_ms"]["reported"] == 8
    assert (tmp_path / "plot.png").stat().st_size > 1000
