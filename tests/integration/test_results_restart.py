"""Results that survive: kill -9 a video server mid-job, restart two processes on the same
--output-dir, and the official SDK lists and downloads the completed job on both while the
interrupted one reports `failed` / `interrupted`; a cancel sent to one replica stops a job running in
the other; a graceful stop (SIGTERM) finishes the jobs running and queued there, MP4s and rows included, and a
job its deadline cut reads `failed` / `shutdown`; `url` images resolve in a process that did not make them."""

from __future__ import annotations

import io
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from diffuserve.media.video import probe_mp4
from tests.conftest import STREAMING_API_KEY
from tests.integration.helpers import stopped_batches, wait_batch_stopped, wait_draining, wait_until
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running

LONG_STEPS = 2000

# Every video method of the SDK warns (the hosted API closed); the wire contract is what we serve.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _create(server: ServerProcess, prompt: str = "a red fox", **body) -> str:
    # The SDK sends videos.create as multipart form fields (extra_body included).
    job = _client(server).videos.create(prompt=prompt, model="tiny-wan", extra_body=body)
    assert job.status == "queued", job
    return job.id


def _wait(client: openai.OpenAI, video_id: str, until, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.videos.retrieve(video_id)
        if until(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {video_id} never reached the state; last: {job}")


def _wan(tiny_wan_path: Path, folder: Path, name: str, *extra: str) -> ServerProcess:
    return ServerProcess(
        [
            "--model-path",
            str(tiny_wan_path),
            "--served-model-name",
            "tiny-wan",
            "--max-inference-steps",
            str(LONG_STEPS),
            "--output-dir",
            str(folder / "outputs"),
            "--result-sweep-interval-s",
            "0.3",
            "--result-ttl-s",
            "3600",
            *extra,
        ],
        folder / f"{name}.log",
        env=StepHold(folder).env(),  # one release file for every server of the test
    )


def test_kill9_restart_and_a_second_replica_share_the_results(tiny_wan_path: Path, tmp_path: Path):
    first = _wan(tiny_wan_path, tmp_path, "first").start(timeout_s=180)
    try:
        client = _client(first)
        done_id = _create(first, num_inference_steps=2, seed=3)
        done = _wait(client, done_id, lambda j: j.status == "completed")
        assert done.expires_at == done.completed_at + 3600
        before = client.videos.download_content(done_id).content
        running_id = _create(first, num_inference_steps=LONG_STEPS, seed=4)
        _wait(client, running_id, lambda j: j.status == "in_progress")
        queued_id = _create(first, num_inference_steps=2, seed=5)
        assert client.videos.retrieve(queued_id).status == "queued"
        first.signal(signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.stop()

    # A restart, and a second replica, on the same folder (started together); the replica's drain is short.
    replicas = [
        _wan(tiny_wan_path, tmp_path, "restarted"),
        _wan(tiny_wan_path, tmp_path, "replica", "--shutdown-timeout-s", "0.5"),
    ]
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(server.start, timeout_s=240) for server in replicas]
    try:
        for future in started:
            future.result()
        for server in replicas:
            client = _client(server)
            jobs = {job.id: job for job in client.videos.list()}
            assert set(jobs) >= {done_id, running_id, queued_id}
            assert jobs[done_id].status == "completed" and jobs[done_id].progress == 100
            for job_id in (running_id, queued_id):
                assert jobs[job_id].status == "failed" and jobs[job_id].error.code == "interrupted", jobs[job_id]
                assert client.videos.retrieve(job_id).error.code == "interrupted"
                with pytest.raises(openai.ConflictError):
                    client.videos.download_content(job_id)
            content = client.videos.download_content(done_id).content
            assert content == before, "the same complete MP4, never a partial one"
            assert probe_mp4(content)["frames"] == 5
        outputs = tmp_path / "outputs"
        assert sorted(p.name for p in (outputs / "media").iterdir()) == [done_id]
        assert list((outputs / "tmp").iterdir()) == []

        # A job created on one replica is seen on the other, and a cancel there stops it here.
        restarted, replica = (_client(s) for s in replicas)
        long_id = _create(replicas[0], num_inference_steps=LONG_STEPS, seed=6)
        _wait(replica, long_id, lambda j: j.status == "in_progress" and j.progress >= 0)
        stopped = stopped_batches(replicas[0].base_url)
        cancelled = httpx.post(f"{replicas[1].base_url}/v1/videos/{long_id}/cancel", timeout=30).json()
        assert cancelled["status"] == "cancelled"
        _wait(restarted, long_id, lambda j: j.status == "cancelled")
        # The owning replica aborted the cancelled job: its batch stopped before its last step.
        assert wait_batch_stopped(replicas[0].base_url, stopped, timeout_s=30) < LONG_STEPS

        # The SDK's multipart create is validated like JSON: 400 naming the field.
        with pytest.raises(openai.BadRequestError) as bad:
            replica.videos.create(prompt="x", seconds="soon")
        assert bad.value.body["param"] == "seconds"

        # Deleting a job (on either replica) removes its files.
        assert replica.videos.delete(done_id).deleted
        assert not (outputs / "media" / done_id).exists()
        with pytest.raises(openai.NotFoundError):
            restarted.videos.retrieve(done_id)

        drained = _drain_the_replicas(replicas, StepHold(tmp_path))
    finally:
        StepHold(tmp_path).release()
        for server in replicas:
            server.stop()

    # After a restart: the drained jobs are complete MP4s (the held one the same bytes as its twin made
    # before), the cut one reads as stopped by the drain.
    after = _wan(tiny_wan_path, tmp_path, "after-drain").start(timeout_s=240)
    try:
        client = _client(after)
        for job_id, mp4 in drained.items():
            if mp4 is None:
                cut = client.videos.retrieve(job_id)
                assert cut.status == "failed" and cut.error.code == "shutdown", cut
                with pytest.raises(openai.ConflictError):
                    client.videos.download_content(job_id)
                continue
            assert client.videos.retrieve(job_id).status == "completed"
            content = client.videos.download_content(job_id).content
            assert probe_mp4(content)["frames"] == 5
            assert mp4 == b"" or content == mp4, job_id
    finally:
        after.stop()


def _drain_the_replicas(replicas: list[ServerProcess], hold: StepHold) -> dict[str, bytes | None]:
    """SIGTERM both replicas while replicas[0] runs a job held at its first step with another queued behind it,
    and replicas[1] (--shutdown-timeout-s 0.5) runs a held job too. replicas[1]'s deadline passes with its job
    held: the job ends `failed`, code `shutdown` (read through replicas[0], which still serves reads while it
    drains). Released, replicas[0] finishes both jobs, files and rows, before it exits 0. Returns the job ids,
    each with the MP4 it must have after a restart (b"": any complete one; None: none, it was cut)."""
    first, second = replicas
    client = _client(first)
    prompt = f"a drained fox {StepHold.MARKER}"
    hold.release()  # the twin runs freely
    twin_id = _create(first, prompt, num_inference_steps=3, seed=8)
    twin = client.videos.download_content(_wait(client, twin_id, lambda j: j.status == "completed").id).content
    hold.arm()
    held_id = _create(first, prompt, num_inference_steps=3, seed=8)
    queued_id = _create(first, num_inference_steps=2, seed=9)
    cut_id = _create(second, prompt, num_inference_steps=3, seed=10)
    for server in replicas:
        wait_until(lambda server=server: running(server), f"{server.base_url} runs its held job")
    assert client.videos.retrieve(queued_id).status == "queued"
    for server in replicas:
        server.signal(signal.SIGTERM)
    wait_draining(first.base_url)
    # The second replica's shutdown timeout (0.5 s) passes with its job held: the job is recorded as stopped.
    cut = _wait(client, cut_id, lambda j: j.status == "failed")
    assert cut.error.code == "shutdown", cut
    assert "stopped during a graceful drain" in cut.error.message and "--shutdown-timeout-s 0.5" in cut.error.message
    assert client.videos.retrieve(held_id).status in ("queued", "in_progress")
    hold.release()
    assert [server.proc.wait(120) for server in replicas] == [0, 0]
    # The first replica drained, cut nothing: its two jobs read `completed` after the restart (the caller checks).
    return {held_id: twin, queued_id: b"", cut_id: None}


def test_url_images_resolve_in_a_process_that_did_not_make_them(streaming_server, tiny_flux_path: Path, tmp_path: Path):
    # The url links are rows and files in the shared folder, not memory: a process started afterwards
    # on the same --output-dir (a restart, or another replica) serves them byte for byte.
    key = {"Authorization": f"Bearer {STREAMING_API_KEY}"}
    made = httpx.post(
        f"{streaming_server.base_url}/v1/images/generations",
        headers=key,
        timeout=60,
        json={
            "prompt": "a red fox",
            "n": 2,
            "size": "64x64",
            "response_format": "url",
            "num_inference_steps": 2,
            "seed": 1,
        },
    ).json()
    urls = [d["url"] for d in made["data"]]
    before = [httpx.get(url, headers=key, timeout=30).content for url in urls]
    other = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--api-key",
            STREAMING_API_KEY,
            "--output-dir",
            str(streaming_server.log_path.parent / "outputs"),
        ],
        tmp_path / "other.log",
    ).start(timeout_s=180)
    try:
        after = [
            httpx.get(url.replace(streaming_server.base_url, other.base_url), headers=key, timeout=30) for url in urls
        ]
        assert [r.status_code for r in after] == [200, 200]
        assert [r.content for r in after] == before
        assert Image.open(io.BytesIO(after[1].content)).size == (64, 64)
        assert (
            httpx.get(f"{other.base_url}/v1/images/{made['id']}x/content", headers=key, timeout=30).status_code == 404
        )
    finally:
        other.stop()
