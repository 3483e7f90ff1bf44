"""Any replica answers any job: diffuserve servers sharing one PostgreSQL database and one S3 bucket (real
servers, tests/stores.py), each with its own empty --output-dir, driven through the official SDK.

A job created on A is listed, polled and downloaded on B (B redirects to a presigned URL, A streams from
the bucket), remixed on B, cancelled and deleted through B (A stops it at its next step); A is SIGKILLed
mid-job and B reports the job `interrupted`; a restarted A still serves every completed result; rows and
objects match one for one at the end."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from diffuserve.media.video import probe_mp4
from tests.serverproc import ServerProcess

LONG_STEPS = 2000

# Every video method of the SDK warns (the hosted API closed); the wire contract is what we serve.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _wait(client: openai.OpenAI, video_id: str, until, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.videos.retrieve(video_id)
        if until(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {video_id} never reached the state; last: {job}")


def _wait_log(server: ServerProcess, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert text in server.log(), f"{text!r} not in the log of {server.base_url}"


def test_any_replica_answers_any_job(tiny_wan_path: Path, postgres_server, s3_server, tmp_path: Path):
    db, media = postgres_server.new_database(), s3_server.new_store_url()

    def replica(name: str, *extra: str) -> ServerProcess:
        return ServerProcess(
            [
                "--model-path",
                str(tiny_wan_path),
                "--served-model-name",
                "tiny-wan",
                "--max-inference-steps",
                str(LONG_STEPS),
                "--output-dir",
                str(tmp_path / name),
                "--results-db",
                db,
                "--media-store",
                media,
                "--s3-endpoint-url",
                s3_server.endpoint,
                "--result-sweep-interval-s",
                "0.5",
                "--owner-timeout-s",
                "30",
                *extra,
            ],
            tmp_path / f"{name}.log",
        )

    a, b = replica("a", "--result-sweep-interval-s", "5"), replica("b", "--media-presign-s", "60")
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(server.start, timeout_s=240) for server in (a, b)]:
            future.result()
    restarted = None
    try:
        on_a, on_b = _client(a), _client(b)
        done_id = on_a.videos.create(
            prompt="a red fox", model="tiny-wan", extra_body={"num_inference_steps": 2, "seed": 3}
        ).id
        done = _wait(on_b, done_id, lambda j: j.status == "completed")
        assert done.progress == 100
        mp4 = on_a.videos.download_content(done_id).content  # streamed through A from the bucket
        assert probe_mp4(mp4)["frames"] == 5
        redirect = httpx.get(f"{b.base_url}/v1/videos/{done_id}/content", timeout=30)
        assert redirect.status_code == 307 and redirect.headers["location"].startswith(s3_server.endpoint)
        assert on_b.videos.download_content(done_id).content == mp4, "the SDK follows the presigned redirect"
        for variant in ("thumbnail", "spritesheet"):
            assert (
                on_b.videos.download_content(done_id, variant=variant).content
                == on_a.videos.download_content(done_id, variant=variant).content
            )

        # Remix on B of A's job; list through either replica (limit / after / order).
        remix = on_b.videos.remix(done_id, prompt="a blue fox")
        assert remix.remixed_from_video_id == done_id
        _wait(on_a, remix.id, lambda j: j.status == "completed")
        for client in (on_a, on_b):
            assert [j.id for j in client.videos.list(order="desc", limit=1).data] == [remix.id]
            assert [j.id for j in client.videos.list(order="asc", limit=5).data] == [done_id, remix.id]
            assert [j.id for j in client.videos.list(after=remix.id).data] == [done_id]

        # A cancel sent to B stops the job A runs, at its next denoising step: PostgreSQL NOTIFY tells A at
        # once (A sweeps only every 5 s, so the log line below is the notification's, not the sweep's).
        long_id = on_a.videos.create(
            prompt="a long fox", model="tiny-wan", extra_body={"num_inference_steps": LONG_STEPS}
        ).id
        _wait(on_a, long_id, lambda j: j.status == "in_progress")
        # (The SDK has no videos.cancel: POST /v1/videos/{id}/cancel as other servers serve it.)
        cancelled = httpx.post(f"{b.base_url}/v1/videos/{long_id}/cancel", timeout=30).json()
        assert cancelled["status"] == "cancelled"
        _wait_log(a, f"video job {long_id} was finished or deleted through another replica (notified)")
        _wait_log(a, "stopped at step")
        assert on_a.videos.retrieve(long_id).status == "cancelled"

        # Delete through B removes the row and the objects.
        assert on_b.videos.delete(remix.id).deleted
        with pytest.raises(openai.NotFoundError):
            on_a.videos.retrieve(remix.id)

        # A dies mid-job (SIGKILL): B fails its job `interrupted`.
        killed_id = on_a.videos.create(
            prompt="a doomed fox", model="tiny-wan", extra_body={"num_inference_steps": LONG_STEPS}
        ).id
        _wait(on_a, killed_id, lambda j: j.status == "in_progress")
        a.signal(signal.SIGKILL)
        a.proc.wait(30)
        failed = _wait(on_b, killed_id, lambda j: j.status == "failed")
        assert failed.error.code == "interrupted"

        # A restart of A (B stopped too: no replica of the first generation is left) loses no completed result.
        b.stop()
        restarted = replica("a2").start(timeout_s=240)
        again = _client(restarted)
        jobs = {job.id: job.status for job in again.videos.list()}
        assert jobs == {done_id: "completed", long_id: "cancelled", killed_id: "failed"}
        assert again.videos.download_content(done_id).content == mp4
    finally:
        for server in (a, b, restarted):
            if server is not None:
                server.stop()

    # The sweep's invariant: every row with media has its objects, and no object lacks its row.
    import psycopg

    with psycopg.connect(db) as conn:
        rows = {rid: files for rid, files in conn.execute("SELECT id, files FROM results")}
    bucket, prefix = media.removeprefix("s3://").split("/", 1)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    objects = {obj["Key"][len(prefix) + 1 :] for obj in listed}
    assert objects == {f"{done_id}/video.mp4"}
    assert set(rows) == {done_id, long_id, killed_id}
