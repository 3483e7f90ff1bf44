"""Mesh jobs across replicas: two tiny Hunyuan3D-2 servers A and B sharing one PostgreSQL database and one S3 bucket
(tests/stores.py). A mesh job runs on A, held at its second DiT step by the `hold_step` fault (so "its next step"
is exact); a cancel sent to B finishes the row, PostgreSQL notifies A, and A stops the job at that step. B then
serves A's completed job's GLB from the bucket. A graceful stop (SIGTERM) of a server running a held mesh job
drains it to the end, GLB and `completed` row, on PostgreSQL + S3 and on SQLite + files, and a restart serves it."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from tests.integration.helpers import stopped_batches, wait_batch_stopped, wait_draining, wait_until
from tests.integration.test_family_hunyuan3d import object_png
from tests.integration.test_meshes_api import _wait
from tests.integration.test_shared_stores import _notified_stops, _start_all
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running

STEPS = 20


def test_a_cancel_on_b_stops_the_mesh_job_running_on_a(tiny_checkpoint, postgres_server, s3_server, tmp_path: Path):
    db, media = postgres_server.new_database(), s3_server.new_store_url()
    hold = StepHold(tmp_path)

    def replica(name: str) -> ServerProcess:
        args = ["--model-path", str(tiny_checkpoint("hunyuan3d")), "--served-model-name", "tiny-h3d"]
        args += ["--output-dir", str(tmp_path / name), "--results-db", db, "--media-store", media]
        args += ["--s3-endpoint-url", s3_server.endpoint, "--owner-timeout-s", "30"]
        # A sweeps rarely: the stop below comes from PostgreSQL's notification, not from a sweep.
        args += ["--result-sweep-interval-s", "5"]
        return ServerProcess(args, tmp_path / f"{name}.log", env=hold.env())

    a, b, c = replica("a"), replica("b"), replica("c")
    _start_all(a, b)
    image = {"image": ("object.png", object_png(), "image/png")}
    try:
        with (
            httpx.Client(base_url=a.base_url, timeout=30) as on_a,
            httpx.Client(base_url=b.base_url, timeout=30) as on_b,
        ):
            done = on_a.post("/v1/meshes", files=image, data={"seed": "1", "octree_resolution": "24"}).json()
            assert _wait(on_b, done["id"])["status"] == "completed"
            assert on_b.get(f"/v1/meshes/{done['id']}/content").content[:4] == b"glTF", "B serves A's GLB"

            hold.arm()
            hold.release(1)
            fields = {"seed": "2", "octree_resolution": "24", "num_inference_steps": str(STEPS)}
            before, notified = stopped_batches(a.base_url), _notified_stops(a, "mesh")
            held = on_a.post("/v1/meshes", files=image, data={**fields, "prompt": StepHold.MARKER}).json()
            # Its first step reported (5% of 20): it is held at step 2 until released.
            wait_until(lambda: on_a.get(f"/v1/meshes/{held['id']}").json()["progress"] >= 5, "step 1 of the held job")
            assert on_b.post(f"/v1/meshes/{held['id']}/cancel").json()["status"] == "cancelled"
            # PostgreSQL's notification told A (A sweeps only every 5 s).
            wait_until(lambda: _notified_stops(a, "mesh") == notified + 1, "A notified of the cancel")
            hold.release()
            assert wait_batch_stopped(a.base_url, before) == 2, "A stopped the job at the held step"
            for client in (on_a, on_b):
                job = client.get(f"/v1/meshes/{held['id']}").json()
                assert job["status"] == "cancelled" and job["progress"] < 100, job

            # A graceful stop of A finishes the job it runs: GLB in the bucket, row `completed`, before A exits.
            drained_id, glb = drain_a_held_job(a, on_a, on_b, hold)
        b.stop()
        # After a restart the drained job's GLB is served, the same bytes as its twin made on B.
        c.start(timeout_s=240)
        with httpx.Client(base_url=c.base_url, timeout=30) as on_c:
            assert on_c.get(f"/v1/meshes/{drained_id}").json()["status"] == "completed"
            assert on_c.get(f"/v1/meshes/{drained_id}/content").content == glb
    finally:
        hold.release()
        for server in (a, b, c):
            server.stop()


def test_a_drained_mesh_job_survives_a_restart(tiny_checkpoint, tmp_path: Path):
    """The same on one host's SQLite + files store: the job held when SIGTERM came is complete after a restart."""
    hold = StepHold(tmp_path)
    args = ["--model-path", str(tiny_checkpoint("hunyuan3d")), "--output-dir", str(tmp_path / "outputs")]
    first = ServerProcess(args, tmp_path / "first.log", env=hold.env()).start(timeout_s=240)
    try:
        with httpx.Client(base_url=first.base_url, timeout=30) as client:
            drained_id, glb = drain_a_held_job(first, client, client, hold)
    finally:
        hold.release()
        first.stop()
    second = ServerProcess(args, tmp_path / "second.log").start(timeout_s=240)
    try:
        job = httpx.get(f"{second.base_url}/v1/meshes/{drained_id}", timeout=30).json()
        assert job["status"] == "completed" and job["progress"] == 100 and job["num_faces"] > 0, job
        assert httpx.get(f"{second.base_url}/v1/meshes/{drained_id}/content", timeout=30).content == glb
        assert (tmp_path / "outputs" / "media" / drained_id / "mesh.glb").read_bytes() == glb
    finally:
        second.stop()


def drain_a_held_job(
    server: ServerProcess, client: httpx.Client, twin_client: httpx.Client, hold: StepHold
) -> tuple[str, bytes]:
    """SIGTERM `server` while a mesh job there is held at its first DiT step; release it once the server drains,
    which then exits 0 after recording it. Returns its id and the GLB of its twin (same seed and settings) made
    freely through `twin_client` before."""
    image = {"image": ("object.png", object_png(), "image/png")}
    fields = {"seed": "5", "octree_resolution": "24", "num_inference_steps": "3", "prompt": StepHold.MARKER}
    hold.release()
    twin = twin_client.post("/v1/meshes", files=image, data=fields).json()
    assert _wait(twin_client, twin["id"])["status"] == "completed"
    glb = twin_client.get(f"/v1/meshes/{twin['id']}/content").content
    assert glb[:4] == b"glTF"
    hold.arm()
    held = client.post("/v1/meshes", files=image, data=fields).json()
    wait_until(lambda: running(server), "the held job runs")  # and cannot finish until released
    server.signal(signal.SIGTERM)
    wait_draining(server.base_url)
    # Reads are answered while it drains (queued or in_progress: with --api-process separate the held first step
    # is not reported yet).
    assert client.get(f"/v1/meshes/{held['id']}").json()["status"] in ("queued", "in_progress")
    hold.release()
    assert server.proc.wait(120) == 0
    # Drained, not cut: its row reads `completed` with its twin's GLB (the callers check it after a restart).
    return held["id"], glb
