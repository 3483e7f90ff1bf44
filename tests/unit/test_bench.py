"""`diffuserve bench` against a real loopback HTTP server that imitates the images and videos APIs.

The fake server is a tiny FastAPI app under uvicorn in a thread. It fails every 7th request it
receives with a 500 in the OpenAI envelope and reports `timings.queue_wait_ms = seed - 100`, so
with concurrency 1 and seeds 100..119 the expected summary can be computed by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

from diffuserve.tools.bench import (
    RequestResult,
    add_bench_arguments,
    percentile,
    plot_runs,
    poisson_arrivals,
    run_bench,
    summarize,
    summarize_setting,
)

pytestmark = pytest.mark.timeout(60)


def _one_pixel_png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1), (255, 0, 0)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


class FakeServerState:
    """What the fake server saw; reset by each test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.video_polls: dict[str, int] = {}
        self.video_seeds: dict[str, int] = {}
        self.cache_hits = 0
        """Image requests whose seed an earlier one had (an exact-result cache would have answered them)."""

    def enter(self, request: Request, body: dict[str, Any]) -> int:
        with self.lock:
            self.count += 1
            self.bodies.append(body)
            self.auth.append(request.headers.get("authorization"))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if "seed" in body and any(b.get("seed") == body["seed"] for b in self.bodies[:-1]):
                self.cache_hits += 1
            return self.count

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


def _envelope(message: str) -> JSONResponse:
    error = {"message": message, "type": "server_error", "param": None, "code": "generation_failed"}
    return JSONResponse({"error": error}, status_code=500)


def _make_app(state: FakeServerState) -> FastAPI:
    app = FastAPI()
    png = _one_pixel_png()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        from fastapi.responses import PlainTextResponse

        hits = f'diffuserve_result_cache_requests_total{{outcome="hit"}} {float(state.cache_hits)}\n'
        return PlainTextResponse(f"# TYPE diffuserve_result_cache_requests counter\n{hits}")

    @app.post("/v1/images/generations")
    async def generate(request: Request) -> Any:
        body = await request.json()
        number = state.enter(request, body)
        try:
            await asyncio.sleep(0.02)  # long enough for concurrent requests to overlap
            if number % 7 == 0:
                return _envelope(f"injected failure #{number}")
            data = [{"b64_json": png} for _ in range(body.get("n", 1))]
            return {"created": 0, "data": data, "timings": {"queue_wait_ms": float(body["seed"] - 100)}}
        finally:
            state.leave()

    @app.post("/v1/videos")
    async def create_video(request: Request) -> Any:
        body = await request.json()
        number = state.enter(request, body)
        state.leave()
        video_id = f"video_{number}"
        state.video_polls[video_id] = 0
        state.video_seeds[video_id] = body["seed"]
        return {"id": video_id, "object": "video", "status": "queued"}

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> Any:
        state.video_polls[video_id] += 1
        if state.video_polls[video_id] < 3:
            return {"id": video_id, "status": "in_progress"}
        if state.video_seeds[video_id] % 3 == 2:
            return {"id": video_id, "status": "failed", "error": {"message": "out of frames"}}
        return {"id": video_id, "status": "completed", "timings": {"queue_wait_ms": 5.0}}

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeServerState]]:
    state = FakeServerState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; handing the socket over avoids a race
    port = sock.getsockname()[1]
    config = uvicorn.Config(_make_app(state), log_level="warning", lifespan="off")
    uv_server = uvicorn.Server(config)
    thread = threading.Thread(target=uv_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not uv_server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    uv_server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture()
def fake(server: tuple[str, FakeServerState]) -> tuple[str, FakeServerState]:
    server[1].reset()
    return server


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="diffuserve bench")
    add_bench_arguments(parser)
    return parser.parse_args(["--no-progress", "--warmup-requests", "0", *argv])


# -- pure summary math ---------------------------------------------------------------------------


def test_percentile_nearest_rank() -> None:
    values = [50, 15, 40, 20, 35]  # sorted: 15 20 35 40 50
    assert percentile(values, 5) == 15  # rank ceil(0.25) = 1
    assert percentile(values, 30) == 20  # rank ceil(1.5) = 2
    assert percentile(values, 40) == 20  # rank 2 exactly
    assert percentile(values, 50) == 35  # rank ceil(2.5) = 3
    assert percentile(values, 100) == 50
    # In floats 57.1 / 100 * 1000 is 571.0000000000001; the nearest rank is still exactly 571.
    assert percentile(list(range(1, 1001)), 57.1) == 571
    assert percentile(list(range(1, 1001)), 99.9) == 999
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize() -> None:
    assert summarize([float(v) for v in range(1, 11)]) == {"mean": 5.5, "p50": 5.0, "p90": 9.0, "p99": 10.0}
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summarize([4.0, 2.0], (50, 99)) == {"mean": 3.0, "p50": 2.0, "p99": 4.0}


def test_summarize_setting() -> None:
    results = [
        RequestResult(True, 10.0, 2, 1.0),
        RequestResult(error="HTTP 500: a"),
        RequestResult(True, 30.0, 2, None),
        RequestResult(error="HTTP 500: a"),
        RequestResult(True, 20.0, 2, 3.0),
        RequestResult(error="HTTP 503: b"),
    ]
    row = summarize_setting(results, concurrency=4, request_rate=math.inf, duration_s=2.0)
    assert (row["completed"], row["failed"]) == (3, 3)
    assert row["errors"] == ["HTTP 500: a", "HTTP 503: b"]  # distinct, in order
    assert row["request_rate"] == "inf"
    assert row["throughput_rps"] == 1.5
    assert row["images_per_s"] == 3.0
    assert row["latency_ms"] == {"mean": 20.0, "p50": 20.0, "p90": 30.0, "p99": 30.0}
    assert row["queue_wait_ms"] == {"mean": 2.0, "p50": 1.0, "p99": 3.0, "reported": 2}
    assert summarize_setting([], concurrency=1, request_rate=2.0, duration_s=0.0)["throughput_rps"] == 0.0


def test_poisson_arrivals() -> None:
    times = poisson_arrivals(4000, 50.0, random.Random(7))
    assert len(times) == 4000
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / 4000 == pytest.approx(1 / 50, rel=0.1)  # mean gap of a rate-50 process
    assert poisson_arrivals(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--concurrency", "1,x"), ("--concurrency", "0"), ("--request-rate", "-1"), ("--size", "64by64")],
)
def test_bad_flags_name_the_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args(flag, value)
    assert flag in capsys.readouterr().err


def test_flag_parsing() -> None:
    args = _args("--concurrency", "1,4,8", "--request-rate", "inf", "--size", "64X32")
    assert args.concurrency == [1, 4, 8]
    assert math.isinf(args.request_rate)
    assert args.size == "64x32"


# -- against the fake server ---------------------------------------------------------------------


def test_closed_loop_counts_percentiles_json_and_plot(
    fake: tuple[str, FakeServerState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, state = fake
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    argv = ["--base-url", base_url, "--num-requests", "20", "--concurrency", "1", "--seed", "100"]
    argv += ["--size", "64x64", "--steps", "4", "--n", "2", "--model", "tiny-flux", "--label", "singleton"]
    status = run_bench(_args(*argv, "--output-json", str(out_json), "--plot", str(out_png)))
    assert status == 1, "failed requests fail the run unless --allow-failures"

    # The server saw exactly the requests we asked for, with the documented body.
    assert state.count == 20
    assert [b["seed"] for b in state.bodies] == list(range(100, 120))
    first = state.bodies[0]
    assert first["size"] == "64x64" and first["num_inference_steps"] == 4 and first["n"] == 2
    assert first["response_format"] == "b64_json" and first["model"] == "tiny-flux"
    assert state.auth[0] is None

    run = json.loads(out_json.read_text())
    assert run["label"] == "singleton" and run["base_url"] == base_url
    assert run["settings"]["num_requests"] == 20 and "api_key" not in json.dumps(run)
    (row,) = run["results"]
    # Requests 7 and 14 (seeds 106 and 113) failed; the 18 others report waits 0..19 minus 6 and 13.
    assert (row["completed"], row["failed"]) == (18, 2)
    assert row["errors"] == ["HTTP 500: injected failure #7", "HTTP 500: injected failure #14"]
    assert row["queue_wait_ms"] == {"mean": 9.5, "p50": 9.0, "p99": 19.0, "reported": 18}
    latency = row["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    assert row["images_per_s"] == pytest.approx(2 * row["throughput_rps"])
    assert row["throughput_rps"] == pytest.approx(18 / row["duration_s"])

    captured = capsys.readouterr()
    printed = captured.out
    assert "lat_p99_ms" in printed and "img/s" in printed and "rate_req/s" in printed
    assert "injected failure #7" in printed
    assert "2 request(s) failed" in captured.err and "--allow-failures" in captured.err
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.size[0] > 100


def test_closed_loop_keeps_concurrency_in_flight(fake: tuple[str, FakeServerState], tmp_path: Path) -> None:
    base_url, state = fake
    out_json = tmp_path / "sweep.json"
    argv = [
        "--base-url",
        base_url,
        "--num-requests",
        "12",
        "--concurrency",
        "2,4",
        "--output-json",
        str(out_json),
        "--allow-failures",
    ]
    assert run_bench(_args(*argv)) == 0
    assert state.count == 24  # 12 per setting
    assert 2 <= state.max_in_flight <= 4
    rows = json.loads(out_json.read_text())["results"]
    assert [r["concurrency"] for r in rows] == [2, 4]
    assert sum(r["completed"] + r["failed"] for r in rows) == 24
    assert sum(r["failed"] for r in rows) == 3  # requests 7, 14 and 21 overall


def test_poisson_mode_sends_the_requested_number(fake: tuple[str, FakeServerState], tmp_path: Path) -> None:
    base_url, state = fake
    out_json = tmp_path / "poisson.json"
    argv = ["--base-url", base_url, "--num-requests", "12", "--concurrency", "3", "--request-rate", "200"]
    assert run_bench(_args(*argv, "--output-json", str(out_json), "--allow-failures")) == 0
    assert state.count == 12
    assert state.max_in_flight <= 3
    (row,) = json.loads(out_json.read_text())["results"]
    assert row["request_rate"] == 200.0
    assert row["completed"] + row["failed"] == 12


def test_warmup_is_not_counted(fake: tuple[str, FakeServerState], tmp_path: Path) -> None:
    base_url, state = fake
    out_json = tmp_path / "warm.json"
    args = _args("--base-url", base_url, "--num-requests", "3", "--output-json", str(out_json))
    args.warmup_requests = 2
    assert run_bench(args) == 0
    assert state.count == 5
    (row,) = json.loads(out_json.read_text())["results"]
    assert row["completed"] + row["failed"] == 3


def test_api_key_flag_and_env(
    fake: tuple[str, FakeServerState], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, state = fake
    assert run_bench(_args("--base-url", base_url, "--num-requests", "2", "--api-key", "sekret-1")) == 0
    assert state.auth == ["Bearer sekret-1"] * 2
    assert "sekret-1" not in capsys.readouterr().out

    state.reset()
    monkeypatch.setenv("DIFFUSERVE_API_KEY", "from-env")
    assert run_bench(_args("--base-url", base_url, "--num-requests", "1")) == 0
    assert state.auth == ["Bearer from-env"]


def test_videos_endpoint_polls_until_done(
    fake: tuple[str, FakeServerState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, state = fake
    out_json = tmp_path / "video.json"
    argv = ["--base-url", base_url, "--endpoint", "videos", "--num-requests", "6", "--concurrency", "2"]
    argv += ["--seed", "0", "--num-frames", "9", "--size", "32x32", "--output-json", str(out_json)]
    assert run_bench(_args(*argv)) == 1  # two jobs fail
    assert run_bench(_args(*argv, "--allow-failures")) == 0
    state.reset()
    assert run_bench(_args(*argv, "--allow-failures")) == 0
    printed = capsys.readouterr().out
    assert "videos/s" in printed and "img/s" not in printed
    assert state.count == 6
    assert state.bodies[0]["num_frames"] == 9 and "n" not in state.bodies[0]
    assert all(polls == 3 for polls in state.video_polls.values())
    (row,) = json.loads(out_json.read_text())["results"]
    # Seeds 0..5: seeds 2 and 5 fail (seed % 3 == 2).
    assert (row["completed"], row["failed"]) == (4, 2)
    assert row["errors"] == ["video failed: out of frames"]
    assert row["queue_wait_ms"]["p50"] == 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    assert run_bench(_args("--base-url", url, "--num-requests", "2")) != 0
    err = capsys.readouterr().err
    assert url in err and "--base-url" in err


def test_bad_base_url_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_args("--base-url", "127.0.0.1:30010")) == 2
    assert "--base-url" in capsys.readouterr().err


def _saved_run(path: Path, label: str, scale: float) -> Path:
    rows = [
        summarize_setting(
            [RequestResult(True, scale * c * (i + 1), 1, None) for i in range(4)],
            concurrency=c,
            request_rate=math.inf,
            duration_s=scale,
        )
        for c in (1, 4, 8)
    ]
    path.write_text(json.dumps({"label": label, "base_url": "http://x", "settings": {}, "results": rows}))
    return path


def test_compare_plots_saved_runs_without_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _saved_run(tmp_path / "a.json", "singleton", 1.0)
    b = _saved_run(tmp_path / "b.json", "dynamic", 0.5)
    out_png = tmp_path / "plots" / "compare.png"
    args = _args("--base-url", "http://127.0.0.1:9", "--compare", str(a), str(b), "--plot", str(out_png))
    assert run_bench(args) == 0
    printed = capsys.readouterr().out
    assert "singleton" in printed and "dynamic" in printed
    with Image.open(out_png) as image:
        assert image.format == "PNG"

    assert run_bench(_args("--compare", str(a))) == 2  # nothing to write the plot to
    assert "--plot" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert run_bench(_args("--compare", str(tmp_path / "bad.json"), "--plot", str(out_png))) == 2
    assert "bad.json" in capsys.readouterr().err


def test_plot_runs_function(tmp_path: Path) -> None:
    a = _saved_run(tmp_path / "a.json", "same", 1.0)
    b = _saved_run(tmp_path / "b.json", "same", 2.0)
    out_png = tmp_path / "o.png"
    plot_runs([a, b], out_png)
    with Image.open(out_png) as image:
        image.load()
        assert image.size[0] > 100


def test_each_setting_and_the_warm_up_get_their_own_seeds_and_cache_hits_warn(
    fake: tuple[str, FakeServerState], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34: seeds repeated across concurrency settings were answered by the server's exact-result cache and
    counted as throughput. Now no seed repeats within a run; a run whose requests the cache answers anyway (the same
    --seed again) says so, from the server's /metrics."""
    base_url, state = fake
    argv = ["--base-url", base_url, "--num-requests", "6", "--concurrency", "1,2", "--seed", "100"]
    assert run_bench(_args(*argv, "--warmup-requests", "2", "--allow-failures")) == 0
    seeds = [b["seed"] for b in state.bodies]
    assert sorted(seeds) == list(range(100, 114)) and state.cache_hits == 0, seeds  # 2 x 6, then 2 warm-up
    assert "warning" not in capsys.readouterr().err
    assert run_bench(_args(*argv[:-1], "102", "--allow-failures")) == 0  # seeds 102..113 again: all repeats
    err = capsys.readouterr().err
    assert "warning: c=1: the server's exact-result cache answered" in err and "--seed" in err, err
    assert "warning: c=2: the server's exact-result cache answered" in err, err
