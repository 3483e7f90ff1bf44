"""Any replica answers any job: diffuserve servers sharing one PostgreSQL database and one S3 bucket (real
servers, tests/stores.py), each with its own empty --output-dir, driven through the official SDK.

Videos (three tiny-Wan replicas A, B, C): a job created on A is listed, polled and downloaded on B (B redirects
to a presigned URL, A streams from the bucket), remixed on B, deleted through B; cancelled from C, A stops it at
its next denoising step (held there by the `hold_step` fault, so "next" is exact; the cancel -> stop latency
of a free-running job is measured and printed); A is SIGKILLed mid-job (held) and B reports the job
`interrupted`; B is stopped gracefully (SIGTERM) with a job held on it, and drains it to the end: MP4 in the
bucket, row `completed`; after a restart of every replica no completed result is lost; rows and objects match
one for one at the end.

Images (two tiny-FLUX replicas): a `response_format="url"` image made on either replica downloads through the
other's URL (streamed from the bucket, or a redirect to a presigned URL)."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from diffuserve.media.video import probe_mp4
from tests.integration.helpers import (
    metric_value,
    stopped_batches,
    wait_batch_stopped,
    wait_draining,
    wait_until,
)
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running

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


def _notified_stops(server: ServerProcess, kind: str) -> float:
    """Jobs `server` stopped because PostgreSQL's notification said another replica finished them (/metrics)."""
    labels = {"kind": kind, "how": "notified"}
    return metric_value(server.base_url, "diffuserve_jobs_stopped_elsewhere_total", labels)


def _start_all(*servers: ServerProcess) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(server.start, timeout_s=240) for server in servers]:
            future.result()


def _rows_and_objects(db: str, media: str, s3_server) -> tuple[dict[str, list[str]], set[str]]:
    """Every row (id -> its files) in PostgreSQL and every object key (under the store's prefix) in the bucket,
    read directly, not through diffuserve."""
    import json

    import psycopg

    with psycopg.connect(db) as conn:
        rows = {rid: json.loads(files) for rid, files in conn.execute("SELECT id, files FROM results")}
    bucket, prefix = media.removeprefix("s3://").split("/", 1)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return rows, {obj["Key"][len(prefix) + 1 :] for obj in listed}


def test_any_replica_answers_any_job(tiny_wan_path: Path, postgres_server, s3_server, tmp_path: Path):
    db, media = postgres_server.new_database(), s3_server.new_store_url()
    hold = StepHold(tmp_path)  # A's marked jobs wait at their denoising steps until the test releases them

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
            env=hold.env(),
        )

    a, b, c = replica("a", "--result-sweep-interval-s", "5"), replica("b", "--media-presign-s", "60"), replica("c")
    _start_all(a, b, c)
    restarted: list[ServerProcess] = []
    try:
        on_a, on_b, on_c = _client(a), _client(b), _client(c)
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

        # Remix on B of A's job; list through every replica (limit / after / order).
        remix = on_b.videos.remix(done_id, prompt="a blue fox")
        assert remix.remixed_from_video_id == done_id
        _wait(on_a, remix.id, lambda j: j.status == "completed")
        for client in (on_a, on_b, on_c):
            assert [j.id for j in client.videos.list(order="desc", limit=1).data] == [remix.id]
            assert [j.id for j in client.videos.list(order="asc", limit=5).data] == [done_id, remix.id]
            assert [j.id for j in client.videos.list(after=remix.id).data] == [done_id]

        # Delete through B removes the row and the objects.
        assert on_b.videos.delete(remix.id).deleted
        with pytest.raises(openai.NotFoundError):
            on_a.videos.retrieve(remix.id)

        # A cancel sent to C stops the job A runs at its next denoising step. The job is held at step 2
        # (steps 1..1 released; its progress, 1% of 100 steps, shows step 1 done), so "next" is exact: PostgreSQL
        # NOTIFY tells A (A sweeps only every 5 s; /metrics counts the stop as `notified`), and once released A
        # stops at step 2 (/metrics: diffuserve_stopped_batch_steps).
        hold.arm()
        hold.release(1)
        held_id = on_a.videos.create(
            prompt=f"a held fox {StepHold.MARKER}", model="tiny-wan", extra_body={"num_inference_steps": 100}
        ).id
        _wait(on_a, held_id, lambda j: j.status == "in_progress" and j.progress >= 1)
        before, notified_before = stopped_batches(a.base_url), _notified_stops(a, "video")
        # (The SDK has no videos.cancel: POST /v1/videos/{id}/cancel as other servers serve it.)
        asked = time.monotonic()
        assert httpx.post(f"{c.base_url}/v1/videos/{held_id}/cancel", timeout=30).json()["status"] == "cancelled"
        wait_until(lambda: _notified_stops(a, "video") == notified_before + 1, "PostgreSQL's notification told A")
        notified = time.monotonic()
        hold.release()
        released = time.monotonic()
        assert wait_batch_stopped(a.base_url, before) == 2, "A stopped the held job at its next step"
        stopped = time.monotonic()
        print(
            f"\ncancel from C -> A notified: {notified - asked:.3f} s; release -> A stopped: {stopped - released:.3f} s"
        )
        for client in (on_a, on_b, on_c):
            held = client.videos.retrieve(held_id)
            assert held.status == "cancelled" and held.progress < 100, held

        # The same for a job running freely: the time from C's cancel request to A's batch stop (/metrics)
        # (measured and printed for the 1 s bound of issue 21; not asserted: this machine's speed varies).
        free_id = on_a.videos.create(
            prompt="a running fox", model="tiny-wan", extra_body={"num_inference_steps": LONG_STEPS}
        ).id
        _wait(on_a, free_id, lambda j: j.status == "in_progress" and j.progress >= 1)  # well into its loop
        before = stopped_batches(a.base_url)
        asked = time.monotonic()
        assert httpx.post(f"{c.base_url}/v1/videos/{free_id}/cancel", timeout=30).json()["status"] == "cancelled"
        step = wait_batch_stopped(a.base_url, before)
        stopped = time.monotonic()
        assert step < LONG_STEPS
        print(f"cancel from C -> A stopped a running job (at step {step}/{LONG_STEPS}): {stopped - asked:.3f} s")
        assert on_b.videos.retrieve(free_id).status == "cancelled"

        # A dies mid-job (SIGKILL, its job held at step 1): B fails the job `interrupted`.
        hold.arm()
        killed_id = on_a.videos.create(
            prompt=f"a doomed fox {StepHold.MARKER}", model="tiny-wan", extra_body={"num_inference_steps": LONG_STEPS}
        ).id
        _wait(on_a, killed_id, lambda j: j.status == "in_progress")  # running (held before its first step ends)
        a.signal(signal.SIGKILL)
        a.proc.wait(30)
        failed = _wait(on_b, killed_id, lambda j: j.status == "failed")
        assert failed.error.code == "interrupted"
        c_done_id = on_c.videos.create(
            prompt="a grey fox", model="tiny-wan", extra_body={"num_inference_steps": 2, "seed": 4}
        ).id
        c_mp4 = on_c.videos.download_content(_wait(on_b, c_done_id, lambda j: j.status == "completed").id).content

        # A graceful stop of B (SIGTERM) finishes the job B runs, held at its first step until B drains: its
        # MP4 lands in the bucket and its row reads `completed` before B exits (checked after the restart).
        drained_id, twin_id, twin = _drain_b(b, on_b, on_c, hold)

        # A restart of every replica (no process of the first generation is left) loses no completed result.
        b.stop()
        c.stop()
        restarted = [replica("a2"), replica("b2", "--media-presign-s", "60"), replica("c2")]
        _start_all(*restarted)
        expected = {
            done_id: "completed",
            held_id: "cancelled",
            free_id: "cancelled",
            killed_id: "failed",
            c_done_id: "completed",
            twin_id: "completed",
            drained_id: "completed",
        }
        for server in restarted:
            again = _client(server)
            assert {job.id: job.status for job in again.videos.list(limit=20)} == expected, server.base_url
            assert again.videos.download_content(done_id).content == mp4
            assert again.videos.download_content(c_done_id).content == c_mp4
            assert again.videos.download_content(drained_id).content == twin, "the drained job's whole MP4"
    finally:
        hold.release()
        for server in (a, b, c, *restarted):
            server.stop()

    # The sweep's invariant, read from PostgreSQL and the bucket directly: every row's files are objects,
    # and every object belongs to a row (the deleted remix left neither).
    rows, objects = _rows_and_objects(db, media, s3_server)
    assert set(rows) == set(expected)
    assert objects == {f"{rid}/{name}" for rid, files in rows.items() for name in files}
    assert objects == {f"{rid}/video.mp4" for rid in (done_id, c_done_id, twin_id, drained_id)}


def _drain_b(b: ServerProcess, on_b: openai.OpenAI, on_c: openai.OpenAI, hold: StepHold) -> tuple[str, str, bytes]:
    """A job held at its first step on B when B gets SIGTERM, released once B drains; B exits 0 after recording it.
    Returns its id, and the id and MP4 of its twin (same prompt, steps and seed) made freely on C before."""
    prompt, fields = f"a drained fox {StepHold.MARKER}", {"num_inference_steps": 3, "seed": 8}
    hold.release()
    twin_id = on_c.videos.create(prompt=prompt, model="tiny-wan", extra_body=fields).id
    twin = on_c.videos.download_content(_wait(on_c, twin_id, lambda j: j.status == "completed").id).content
    hold.arm()
    drained_id = on_b.videos.create(prompt=prompt, model="tiny-wan", extra_body=fields).id
    wait_until(lambda: running(b), "B runs the held job")
    b.signal(signal.SIGTERM)
    wait_draining(b.base_url)
    assert on_b.videos.retrieve(drained_id).status in ("queued", "in_progress"), "B answers reads while it drains"
    hold.release()
    assert b.proc.wait(120) == 0
    # Drained, not cut: the job's row reads `completed` and its MP4 is its twin's (checked after the restart).
    return drained_id, twin_id, twin


def test_url_images_through_any_replica(tiny_flux_path: Path, postgres_server, s3_server, tmp_path: Path):
    """A `response_format="url"` image made on one replica downloads through the other's URL: D streams it
    from the bucket, E (with --media-presign-s) redirects to a presigned URL of the object."""
    db, media = postgres_server.new_database(), s3_server.new_store_url()

    def replica(name: str, *extra: str) -> ServerProcess:
        return ServerProcess(
            [
                "--model-path",
                str(tiny_flux_path),
                "--served-model-name",
                "tiny-flux",
                "--output-dir",
                str(tmp_path / name),
                "--results-db",
                db,
                "--media-store",
                media,
                "--s3-endpoint-url",
                s3_server.endpoint,
                *extra,
            ],
            tmp_path / f"{name}.log",
        )

    d, e = replica("d"), replica("e", "--media-presign-s", "60")
    # D's URL carries a password (the test cluster trusts every local connection, so any works): the start-up log
    # and /server_info name the store in use, never the password (issue 34).
    d.args[d.args.index(db)] = db.replace("postgresql://postgres@", "postgresql://postgres:pw-never-shown@")
    _start_all(d, e)
    try:
        info = httpx.get(f"{d.base_url}/server_info", timeout=30).json()
        bucket, prefix = media.removeprefix("s3://").split("/", 1)
        assert info["results_store"] == {
            "metadata": {
                "kind": "postgresql",
                "host": "127.0.0.1",
                "port": postgres_server.port,
                "database": db.rsplit("/", 1)[1],
            },
            "media": {"kind": "s3", "endpoint": s3_server.endpoint, "bucket": bucket, "prefix": prefix + "/"},
        }, info["results_store"]
        assert "pw-never-shown" not in httpx.get(f"{d.base_url}/server_info", timeout=30).text + d.log()
        said = f"results store: metadata in PostgreSQL 127.0.0.1:{postgres_server.port}/{db.rsplit('/', 1)[1]}; "
        assert said + f"files in S3 bucket {bucket}, prefix {prefix}/ at {s3_server.endpoint}" in d.log(), d.log()
        made: dict[str, tuple[str, bytes]] = {}
        for maker in (d, e):
            result = _client(maker).images.generate(
                model="tiny-flux", prompt=f"a fox from {maker.port}", size="64x64", n=1, response_format="url"
            )
            url = result.data[0].url
            assert url is not None and url.startswith(maker.base_url), url
            path = urlsplit(url).path + "?" + urlsplit(url).query
            made[maker.base_url] = (path, httpx.get(url, follow_redirects=True, timeout=30).content)
        for maker, other in ((d, e), (e, d)):
            path, image = made[maker.base_url]
            assert image.startswith(b"\x89PNG"), image[:16]
            through_other = httpx.get(f"{other.base_url}{path}", timeout=30)
            if other is e:  # presigned: a redirect into the bucket, which serves the same bytes
                assert through_other.status_code == 307, through_other.text
                assert through_other.headers["location"].startswith(s3_server.endpoint)
                through_other = httpx.get(through_other.headers["location"], timeout=30)
            assert through_other.status_code == 200 and through_other.content == image, other.base_url
    finally:
        for server in (d, e):
            server.stop()

    rows, objects = _rows_and_objects(db, media, s3_server)
    assert len(rows) == 2 and objects == {f"{rid}/{name}" for rid, files in rows.items() for name in files}
