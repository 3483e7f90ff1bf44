"""Real `diffuserve serve --num-gpus 2 --device cpu` servers, called with the official openai client.

- CFG parallel over 2 ranks: a request's image is bit-identical to the single-process run; a merged batch equals
  its singletons within the dynamic-batching tolerance (1/255); a batch that raises on every rank fails its
  requests and the server keeps serving; a deadline mid-run stops every rank at one step; /server_info shows
  the ranks; a killed rank fails the in-flight request with an error naming it, /health turns 503 and the
  server exits non-zero.
- `generate --num-gpus 2` is bit-identical; impossible combinations are refused before any weight loads.
- Two data-parallel replicas: load is spread over both; a stopped (SIGSTOP) rank is declared hung after the
  heartbeat timeout, with the same consequences.
- Two "hosts" on 127.0.0.1 (`--nnodes 2 --node-rank 0/1 --dist-init-addr`) with FSDP x Ulysses 2, after an idle
  period longer than the group timeout: equal to one process within 1/255.
- torchrun with 4 ranks, CFG parallel x Ulysses 2, continuous batching with a request joining mid-run: each
  equal to its one-process singleton within 1/255.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.serverproc import REPO, ServerProcess, free_port
from tests.step_hold import StepHold, running, seconds_after_running, wait_idle

ENV = {"OMP_NUM_THREADS": "1", "DIFFUSERVE_FAULT_INJECTION": "prompt:BOOM"}
CFG = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _generate(
    server: ServerProcess, prompt: str, seed: int, steps: int = 3, size: str = "64x64", **extra
) -> np.ndarray:
    result = _client(server).images.generate(
        model=_client(server).models.list().data[0].id,
        prompt=prompt,
        size=size,
        response_format="b64_json",
        extra_body={"num_inference_steps": steps, "seed": seed, **CFG, **extra},
    )
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def reference(tiny_flux_path: Path):
    """The single-process pipeline the ranks must reproduce."""
    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import build_sampling_params

    pipe = load_pipeline(tiny_flux_path)

    def run(prompt: str, seed: int, steps: int = 3) -> np.ndarray:
        params = build_sampling_params(
            pipe.describe_model(), prompt=prompt, width=64, height=64, num_inference_steps=steps, seed=seed, **CFG
        )
        return np.asarray(pipe.run([params]).outputs[0].images[0].convert("RGB"), dtype=np.int16)

    return run


def _start(tiny_flux_path: Path, tmp: Path, *flags: str) -> ServerProcess:
    """A server whose ranks also hold marked requests' steps (`tests/step_hold.py`, release file beside the log)."""
    return ServerProcess(
        args=["--model-path", str(tiny_flux_path), "--device", "cpu", *flags],
        log_path=tmp / "server.log",
        env={**ENV, **StepHold(tmp).env(fail_marker="BOOM")},
    ).start(timeout_s=300)


def _hold(server: ServerProcess) -> StepHold:
    return StepHold(server.log_path.parent)


def _metric(server: ServerProcess, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def _rank_pid(server: ServerProcess, rank: int) -> int:
    info = httpx.get(f"{server.base_url}/server_info").json()["distributed"]
    return next(r["pid"] for r in info["ranks"] if r["rank"] == rank)


def _wait_exit(server: ServerProcess, timeout_s: float = 60) -> int:
    assert server.proc is not None
    return server.proc.wait(timeout_s)


def _fault_follows(server: ServerProcess, rank: int, how: int, expected: str) -> None:
    """Hurt `rank` while a long request runs: the request fails naming it, /health 503, exit non-zero. The request
    is held at a step until the rank is hurt, so it is mid-run then however fast the machine is."""
    pid = _rank_pid(server, rank)
    outcome: dict[str, BaseException | None] = {}
    hold = _hold(server)
    hold.arm()
    wait_idle(server)  # the batch seen running below is this request's

    def slow() -> None:
        try:
            _generate(server, f"a long one {StepHold.MARKER}", seed=3, steps=190)
            outcome["error"] = None
        except BaseException as exc:  # the assertion below reports it
            outcome["error"] = exc

    thread = threading.Thread(target=slow)
    thread.start()
    deadline = time.monotonic() + 60
    while not running(server):  # gate on observed state (held at a step: it cannot finish meanwhile)
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)
    os.kill(pid, how)
    try:
        thread.join(90)  # answered by the rank monitor while rank 0 still holds the step
        hold.release()
        assert not thread.is_alive(), "the in-flight request was never answered"
        error = outcome["error"]
        assert isinstance(error, openai.APIStatusError), error
        assert f"rank {rank}" in error.message and expected in error.message, error.message
        try:  # the error went out after the engine turned FAILED: /health says 503 until the process is gone
            assert httpx.get(f"{server.base_url}/health").status_code == 503
        except httpx.HTTPError:
            pass  # already exited
        code = _wait_exit(server)
        assert code != 0, server.log()[-3000:]
        assert f"rank {rank}" in server.log()
    finally:
        hold.release()
        if how == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop()


# ---------------------------------------------------------------------------------------------- CFG parallel
@pytest.fixture(scope="module")
def cfg_server(tiny_flux_path, tmp_path_factory):
    server = _start(
        tiny_flux_path,
        tmp_path_factory.mktemp("cfg-ranks"),
        "--num-gpus",
        "2",
        "--enable-cfg-parallel",
        "--batching-mode",
        "dynamic",
        "--batching-max-size",
        "4",
        "--batching-delay-ms",
        "1500",
        "--dist-heartbeat-timeout-s",
        "10",
    )
    yield server
    server.stop()


def test_cfg_parallel_serve_is_bit_identical_to_one_process(cfg_server, reference):
    assert (_generate(cfg_server, "a red fox", seed=1) == reference("a red fox", seed=1)).all()
    info = httpx.get(f"{cfg_server.base_url}/server_info").json()
    assert info["deployment_plan"]["cfg_parallel"] is True
    dist = info["distributed"]
    assert dist["world_size"] == 2 and dist["cfg"] == 2 and {r["rank"] for r in dist["ranks"]} == {0, 1}
    assert all(r["pid"] for r in dist["ranks"]) and info["replicas"][0]["ranks"] == [0, 1]


def test_merged_batch_under_cfg_parallel_equals_its_singletons(cfg_server, reference):
    merged_before = sum(_metric(cfg_server, "diffuserve_batch_merged_dispatches_total").values())
    prompts = [("a cat on a long sandy beach", 5), ("a dog", 6)]
    images: dict[int, np.ndarray] = {}
    # They meet in the queue behind a held request, however slowly they arrive (not within the batching delay).
    hold = _hold(cfg_server)
    hold.arm()
    wait_idle(cfg_server)
    held = threading.Thread(target=lambda: _generate(cfg_server, f"held {StepHold.MARKER}", 7, steps=2))
    threads = [
        threading.Thread(target=lambda p=p, s=s: images.__setitem__(s, _generate(cfg_server, p, s))) for p, s in prompts
    ]
    held.start()
    try:
        deadline = time.monotonic() + 60
        while not running(cfg_server):
            assert time.monotonic() < deadline, "the held request never started"
            time.sleep(0.05)
        for thread in threads:
            thread.start()
        while sum(_metric(cfg_server, "diffuserve_queue_depth").values()) < 2:
            assert time.monotonic() < deadline, "the two requests never queued"
            time.sleep(0.05)
    finally:
        hold.release()
    for thread in [held, *threads]:
        thread.join(120)
    assert sum(_metric(cfg_server, "diffuserve_batch_merged_dispatches_total").values()) == merged_before + 1
    for prompt, seed in prompts:
        assert np.abs(images[seed] - reference(prompt, seed)).max() <= 1, prompt  # dynamic-batching tolerance


def test_a_batch_failing_on_every_rank_fails_its_request_and_the_ranks_keep_serving(cfg_server, reference):
    with pytest.raises(openai.InternalServerError) as err:
        _generate(cfg_server, "BOOM goes the stage", seed=2)
    assert "InjectedFault" in err.value.message
    assert (_generate(cfg_server, "a red fox", seed=1) == reference("a red fox", seed=1)).all()


def test_a_deadline_mid_run_stops_every_rank_at_the_same_step(cfg_server, reference):
    """Rank 0 decides the deadline at a step boundary and every rank stops there (or the next call would hang).
    The ranks hold the first step until the deadline has passed, so the run is cut off mid-run on any machine."""
    hold = _hold(cfg_server)
    hold.arm()
    releaser = hold.release_when(seconds_after_running(cfg_server, 3))
    with pytest.raises(openai.APIStatusError) as err:  # ~1.5 s queued (batching delay), then cut off mid-run
        _generate(cfg_server, f"a long one {StepHold.MARKER}", seed=4, steps=190, size="256x256", timeout=3)
    releaser.join(10)
    assert err.value.status_code == 504 and "cancelled at step" in err.value.message, err.value.message
    step, total = (int(v) for v in err.value.message.split("cancelled at step ")[1].split(".")[0].split("/"))
    assert 0 < step < total == 190
    assert (_generate(cfg_server, "a red fox", seed=1) == reference("a red fox", seed=1)).all()


def test_a_killed_rank_fails_the_in_flight_request_naming_it_and_the_server_exits(cfg_server):
    _fault_follows(cfg_server, 1, signal.SIGKILL, "exited")
    assert "signal 9" in cfg_server.log()


# ---------------------------------------------------------------------------------------------- replicas
def test_data_parallel_replicas_share_the_load_and_a_hung_rank_is_declared(tiny_flux_path, tmp_path, reference):
    server = _start(
        tiny_flux_path,
        tmp_path,
        "--num-gpus",
        "2",
        "--dp-size",
        "2",
        "--batching-mode",
        "dynamic",
        "--batching-max-size",
        "2",
        "--dist-heartbeat-timeout-s",
        "3",
    )
    try:
        results: list[np.ndarray] = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(_generate(server, "a red fox", seed=1)))
            for i in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        single = reference("a red fox", seed=1)
        assert len(results) == 6 and all(np.abs(r - single).max() <= 1 for r in results)  # merged pairs: 1/255
        rows = _metric(server, "diffuserve_replica_rows")
        assert set(rows) == {(("replica", "0"),), (("replica", "1"),)} and all(v >= 1 for v in rows.values()), rows
        replicas = httpx.get(f"{server.base_url}/server_info").json()["replicas"]
        assert [r["ranks"] for r in replicas] == [[0], [1]] and all(r["batches"] >= 1 for r in replicas)
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        # The next batch goes to the free replica with the fewest rows: make that replica 1, whose rank is stopped.
        while (rows := _metric(server, "diffuserve_replica_rows"))[(("replica", "1"),)] >= rows[(("replica", "0"),)]:
            _generate(server, "a red fox", seed=1)
    except BaseException:
        server.stop()
        raise
    _fault_follows(server, 1, signal.SIGSTOP, "no heartbeat")


# ---------------------------------------------------------------------------------------------- two hosts
def test_two_hosts_with_fsdp_times_ulysses_equal_one_process(tiny_flux_path, tmp_path, reference):
    addr = f"127.0.0.1:{free_port()}"
    # --dist-timeout-s 5 and an idle group for longer: ranks waiting for work are never inside a collective.
    common = [
        "--num-gpus",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        addr,
        "--use-fsdp-inference",
        "--ulysses-degree",
        "2",
        "--dist-timeout-s",
        "5",
    ]
    node1_log = open(tmp_path / "node1.log", "wb")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(tiny_flux_path),
            "--device",
            "cpu",
            "--node-rank",
            "1",
            *common,
        ],
        stdout=node1_log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **ENV},
        cwd=REPO,
    )
    try:
        node0 = _start(tiny_flux_path, tmp_path, "--node-rank", "0", *common)
        try:
            time.sleep(6)  # the condition under test is the idle time itself: longer than the group timeout
            # FSDP is exact; the Ulysses split reorders float sums (within 1e-5 in latents, 1/255 in pixels).
            assert np.abs(_generate(node0, "a red fox", seed=1) - reference("a red fox", seed=1)).max() <= 1
            plan = httpx.get(f"{node0.base_url}/server_info").json()["deployment_plan"]
            assert plan["fsdp"] is True and plan["ulysses_degree"] == 2
        finally:
            assert node0.stop() == 0
        node1_code = node1.wait(30)  # left on node 0's shutdown
        assert node1_code == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()


# ---------------------------------------------------------------------------------------------- torchrun, 4 ranks
def test_torchrun_four_ranks_continuous_cfg_parallel_times_ulysses(tiny_flux_path, tmp_path, reference):
    """torchrun starts the ranks (rank 0 serves); CFG 2 x Ulysses 2 with continuous batching: a request joins the
    running denoise group at a later step, and each equals its one-process singleton within 1/255."""
    port, log = free_port(), open(tmp_path / "torchrun.log", "wb")  # noqa: SIM115 - closed below
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen(
        [
            str(torchrun),
            "--nproc-per-node",
            "4",
            "--master-port",
            str(free_port()),
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(tiny_flux_path),
            "--device",
            "cpu",
            "--num-gpus",
            "4",
            "--enable-cfg-parallel",
            "--ulysses-degree",
            "2",
            "--port",
            str(port),
            "--batching-mode",
            "continuous",
            "--batching-max-size",
            "4",
            "--output-dir",
            str(tmp_path / "outputs"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **ENV},
        cwd=REPO,
    )
    server = ServerProcess(args=[], log_path=tmp_path / "torchrun.log", port=port)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, server.log()[-3000:]
            try:
                if httpx.get(f"{server.base_url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        dist = httpx.get(f"{server.base_url}/server_info").json()["distributed"]
        assert (dist["world_size"], dist["cfg"], dist["ulysses"]) == (4, 2, 2)
        images: dict[int, np.ndarray] = {}
        first = threading.Thread(target=lambda: images.__setitem__(1, _generate(server, "a red fox", 1, steps=60)))
        first.start()
        joins_before = sum(_metric(server, "diffuserve_continuous_joins_total").values())
        deadline = time.monotonic() + 120
        while sum(_metric(server, "diffuserve_continuous_joins_total").values()) < joins_before + 1:
            assert time.monotonic() < deadline, server.log()[-3000:]  # the first request is in the group
            time.sleep(0.05)
        images[5] = _generate(server, "a cat on a long sandy beach", 5, steps=4)  # joins mid-run, leaves first
        first.join(120)
        assert np.abs(images[1] - reference("a red fox", 1, steps=60)).max() <= 1
        assert np.abs(images[5] - reference("a cat on a long sandy beach", 5, steps=4)).max() <= 1
        assert sum(_metric(server, "diffuserve_continuous_joins_total").values()) == joins_before + 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# ---------------------------------------------------------------------------------------------- generate, refusals
def test_generate_on_two_ranks_with_cfg_parallel_is_bit_identical(tiny_flux_path, tmp_path, reference):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "generate",
            "--model-path",
            str(tiny_flux_path),
            "--device",
            "cpu",
            "--num-gpus",
            "2",
            "--enable-cfg-parallel",
            "--prompt",
            "a red fox",
            "--negative-prompt",
            "blurry",
            "--true-cfg-scale",
            "4",
            "--seed",
            "1",
            "--width",
            "64",
            "--height",
            "64",
            "--num-inference-steps",
            "3",
            "--output-path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    image = np.asarray(Image.open(out.stdout.strip().splitlines()[-1]).convert("RGB"), dtype=np.int16)
    assert (image == reference("a red fox", seed=1)).all()
    assert "[rank 1]" in out.stderr and "cfg parallel" in out.stderr  # the second rank ran its branch


@pytest.mark.parametrize(
    ("build", "flags", "named"),
    [
        ("flux", ["--num-gpus", "2", "--tp-size", "3"], "--tp-size 3"),  # degrees that do not multiply to the ranks
        ("flux", ["--num-gpus", "4", "--ulysses-degree", "2"], "--dp-size 2"),  # explicit degrees must fill them
        ("sd3", ["--num-gpus", "2", "--ulysses-degree", "2"], "no sequence split"),  # a family without a split
        ("flux", ["--num-gpus", "2", "--ulysses-degree", "4"], "does not divide"),  # heads (tiny FLUX has 2)
    ],
)
def test_serve_refuses_what_cannot_run_before_loading_weights(tiny_checkpoint, build, flags, named):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(tiny_checkpoint(build)),
            "--device",
            "cpu",
            "--port",
            "0",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr and "configuration error" in out.stderr, out.stderr[-2000:]
    assert "Loading" not in out.stderr  # refused from the plan, before any weight was read
