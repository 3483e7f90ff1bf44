"""Text-to-video end to end on the tiny Wan2.1 checkpoint: backend fidelity against diffusers'
WanPipeline, and the async job API of one real server (create, poll, content, list, cancel, delete,
bad requests, merged jobs, `diffuserve bench --endpoint videos`)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from diffuserve.media.video import probe_mp4
from tests.integration.conftest import LONG_STEPS
from tests.integration.helpers import metric_value, stopped_batches, wait_batch_stopped
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, seconds_after_running


def test_backend_frames_equal_wan_pipeline(tiny_wan_path: Path):
    import torch
    from diffusers import WanPipeline

    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    backend = load_pipeline(tiny_wan_path)
    assert backend.family == "wan" and backend.output_kind == "video"
    assert (backend.defaults.width, backend.defaults.num_frames, backend.defaults.fps) == (32, 5, 8)
    common = {"width": 32, "height": 48, "num_frames": 5, "num_inference_steps": 3, "output_format": "mp4"}
    batch = [
        SamplingParams(prompt="a red fox", seed=3, n=2, **common),
        SamplingParams(prompt="a cat surfing", negative_prompt="blurry", seed=9, **common),
    ]
    outputs = backend.run(batch).outputs
    assert [len(o.videos) for o in outputs] == [2, 1]
    direct = WanPipeline.from_pretrained(tiny_wan_path, local_files_only=True)
    direct.set_progress_bar_config(disable=True)
    # Row j of a request uses seed + j, so request 0's second row is the direct run with seed 4.
    for video, prompt, negative, seed in (
        (outputs[0].videos[1], "a red fox", None, 4),
        (outputs[1].videos[0], "a cat surfing", "blurry", 9),
    ):
        with torch.inference_mode():
            frames = direct(
                prompt=prompt,
                negative_prompt=negative,
                height=48,
                width=32,
                num_frames=5,
                num_inference_steps=3,
                generator=torch.Generator().manual_seed(seed),
                output_type="np",
            ).frames[0]
        expected = (np.clip(frames, 0, 1) * 255).round()
        got = np.stack([np.asarray(f, dtype=np.float64) for f in video])
        assert got.shape == (5, 48, 32, 3)
        assert np.abs(got - expected).max() <= 1.0


def _create(server: ServerProcess, **body) -> dict:
    response = httpx.post(f"{server.base_url}/v1/videos", json={"prompt": "a red fox", **body}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _get(server: ServerProcess, video_id: str) -> dict:
    response = httpx.get(f"{server.base_url}/v1/videos/{video_id}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _wait(server: ServerProcess, video_id: str, until, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = _get(server, video_id)
        if until(job):
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {video_id} never reached the state; last: {job}\n{server.log()[-2000:]}")


def _frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.int16)


def _finished(job: dict) -> bool:
    return job["status"] in ("completed", "failed", "cancelled")


def test_create_poll_and_download(wan_server):
    job = _create(wan_server, size="48x32", num_frames=9, fps=12, num_inference_steps=3, seed=5)
    assert job["object"] == "video" and job["status"] == "queued" and job["progress"] == 0
    assert (job["model"], job["size"], job["num_frames"], job["seconds"]) == ("tiny-wan", "48x32", 9, "0.75")
    done = _wait(wan_server, job["id"], _finished)
    assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None
    assert done["timings"]["batch_size"] == 1 and done["timings"]["inference_ms"] > 0
    content = httpx.get(f"{wan_server.base_url}/v1/videos/{job['id']}/content", timeout=30)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    info = probe_mp4(content.content)
    assert (info["frames"], info["width"], info["height"], info["fps"]) == (9, 48, 32, 12.0)
    # Defaults come from the checkpoint; `seconds` picks the nearest 4k+1 frame count.
    default = _wait(wan_server, _create(wan_server, seconds="1")["id"], _finished)
    assert (default["size"], default["num_frames"], default["fps"], default["status"]) == ("32x32", 9, 8, "completed")


def test_list_get_delete(wan_server):
    ids = [_create(wan_server, num_inference_steps=1, seed=i)["id"] for i in range(3)]
    for video_id in ids:
        _wait(wan_server, video_id, _finished)
    listed = httpx.get(f"{wan_server.base_url}/v1/videos", params={"limit": 2}).json()
    assert listed["object"] == "list" and [j["id"] for j in listed["data"]] == ids[::-1][:2] and listed["has_more"]
    rest = httpx.get(f"{wan_server.base_url}/v1/videos", params={"limit": 1, "after": ids[1]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]]
    deleted = httpx.delete(f"{wan_server.base_url}/v1/videos/{ids[0]}").json()
    assert deleted == {"id": ids[0], "object": "video.deleted", "deleted": True}
    for path in ("", "/content"):
        gone = httpx.get(f"{wan_server.base_url}/v1/videos/{ids[0]}{path}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    assert httpx.delete(f"{wan_server.base_url}/v1/videos/{ids[0]}").status_code == 404
    done_cancel = httpx.post(f"{wan_server.base_url}/v1/videos/{ids[1]}/cancel")
    assert done_cancel.status_code == 409 and done_cancel.json()["error"]["param"] == "video_id"
    assert done_cancel.json()["error"]["code"] == "video_already_finished"
    assert "nothing to cancel" in done_cancel.json()["error"]["message"]


@pytest.fixture
def hold(wan_server: ServerProcess) -> Iterator[StepHold]:
    """Armed for the test; released at its end whatever happened (so the shared server never stays held)."""
    held = StepHold(wan_server.log_path.parent)
    held.arm()
    yield held
    held.release()


def test_cancel_queued_and_running_progress_and_merged_jobs(wan_server, hold):
    base = wan_server.base_url
    cancelled_before = metric_value(base, "diffuserve_requests_cancelled_before_run_total")
    stops_before = stopped_batches(base)
    # The long job may run its first 100 steps (progress rises), then waits until it is cancelled below: it is
    # still running meanwhile on any machine.
    hold.release(steps=100)
    long = _create(
        wan_server,
        prompt=f"a red fox {StepHold.MARKER}",
        size="64x64",
        num_frames=9,
        num_inference_steps=LONG_STEPS,
        seed=1,
    )
    _wait(wan_server, long["id"], lambda j: j["status"] == "in_progress")
    # Queued behind it: one to cancel, and two compatible jobs that must merge once it is gone.
    doomed = _create(wan_server, prompt="never runs", num_inference_steps=2)
    pair = [_create(wan_server, prompt=f"merged {i}", num_inference_steps=2, seed=40 + i) for i in range(2)]
    assert _get(wan_server, doomed["id"])["status"] == "queued"
    waiting = httpx.get(f"{base}/v1/videos/{doomed['id']}/content")
    assert waiting.status_code == 409 and waiting.json()["error"]["code"] == "video_not_ready"
    cancelled = httpx.post(f"{base}/v1/videos/{doomed['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["progress"] == 0
    assert metric_value(base, "diffuserve_requests_cancelled_before_run_total") == cancelled_before + 1
    # Progress of the running job comes from real denoising steps and only rises.
    seen, deadline = [_get(wan_server, long["id"])["progress"]], time.monotonic() + 30
    while seen[-1] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        seen.append(_get(wan_server, long["id"])["progress"])
    assert seen == sorted(seen) and 0 < seen[-1] < 100
    stopped = httpx.post(f"{base}/v1/videos/{long['id']}/cancel").json()
    assert stopped["status"] == "cancelled" and stopped["error"]["code"] == "cancelled"
    hold.release()  # the cancelled job stops at its next step boundary
    jobs = [_wait(wan_server, j["id"], _finished) for j in pair]
    assert [j["status"] for j in jobs] == ["completed", "completed"]
    assert [j["timings"]["batch_size"] for j in jobs] == [2, 2], "compatible queued jobs run as one batch"
    assert wait_batch_stopped(base, stops_before) <= 101, "the cancelled job's batch stopped at its next step"
    assert _get(wan_server, long["id"])["status"] == "cancelled"
    assert _get(wan_server, doomed["id"])["timings"] is None
    # A merged row equals its singleton run.
    alone = _wait(wan_server, _create(wan_server, prompt="merged 1", num_inference_steps=2, seed=41)["id"], _finished)
    assert alone["timings"]["batch_size"] == 1
    merged_frames, alone_frames = (
        _frames(httpx.get(f"{base}/v1/videos/{j['id']}/content").content) for j in (jobs[1], alone)
    )
    assert np.abs(merged_frames - alone_frames).max() <= 2


def test_job_deadline_is_the_servers_not_a_clients(wan_server, hold):
    # The job's own `timeout` (capped by --request-timeout-s) bounds it inside the engine: past it the
    # running job stops at a step boundary and reports `timeout`. No client connection is involved.
    # Its steps are held until the deadline has passed, so it is still running then on any machine.
    releaser = hold.release_when(seconds_after_running(wan_server, 0.5))
    job = _create(wan_server, prompt=f"too slow {StepHold.MARKER}", num_inference_steps=LONG_STEPS, timeout=0.5)
    failed = _wait(wan_server, job["id"], _finished)
    releaser.join(10)
    assert failed["status"] == "failed" and failed["error"]["code"] == "timeout", failed
    assert "deadline" in failed["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "num_frames": 4}, "num_frames"),
        ({"prompt": "x", "num_frames": 0}, "num_frames"),
        ({"prompt": "x", "size": "40x32"}, "size"),
        ({"prompt": "x", "size": "wide"}, "size"),
        (
            {"prompt": "x", "size": "1024x1024"},
            "size",
        ),  # beyond the tiny checkpoint's rotary table: 400, not a job error
        ({"prompt": "x", "surprise": True}, "surprise"),
        ({"prompt": "  "}, "prompt"),
        (
            {"prompt": "x", "seconds": "soon", "num_frames": 5},
            "seconds",
        ),  # with num_frames too (it wins), still checked
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "num_inference_steps": LONG_STEPS + 1}, "num_inference_steps"),
    ],
)
def test_bad_requests_name_the_field(wan_server, body, param):
    response = httpx.post(f"{wan_server.base_url}/v1/videos", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_404_model_not_found(wan_server):
    response = httpx.post(f"{wan_server.base_url}/v1/videos", json={"prompt": "x", "model": "other"}, timeout=30)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found" and response.json()["error"]["param"] == "model"


def test_video_model_refuses_image_requests(wan_server):
    response = httpx.post(f"{wan_server.base_url}/v1/images/generations", json={"prompt": "x"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model" and "/v1/videos" in response.json()["error"]["message"]


def test_bench_videos_endpoint(wan_server, tmp_path: Path):
    out_json = tmp_path / "videos.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "bench",
            "--base-url",
            wan_server.base_url,
            "--endpoint",
            "videos",
            "--num-requests",
            "3",
            "--concurrency",
            "2",
            "--size",
            "32x32",
            "--steps",
            "1",
            "--num-frames",
            "5",
            "--output-json",
            str(out_json),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())["results"][0]
    assert result["completed"] == 3 and result["failed"] == 0


def test_generate_cli_writes_mp4_for_a_video_model(tiny_wan_path: Path, tmp_path: Path):
    import subprocess
    import sys

    from diffuserve.media.video import probe_mp4

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "generate",
            "--model-path",
            str(tiny_wan_path),
            "--prompt",
            "a wave",
            "--num-frames",
            "5",
            "--fps",
            "8",
            "--num-inference-steps",
            "2",
            "--output-path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    [path] = [Path(line) for line in out.stdout.split() if line.endswith(".mp4")]
    info = probe_mp4(path.read_bytes())
    assert info["frames"] == 5 and info["fps"] == 8
