"""Mesh jobs across replicas: two tiny Hunyuan3D-2 servers A and B sharing one PostgreSQL database and one S3 bucket
(tests/stores.py). A mesh job runs on A, held at its second DiT step by the `hold_step` fault (so "its next step"
is exact); a cancel sent to B finishes the row, PostgreSQL notifies A, and A stops the job at that step. B then
serves A's completed job's GLB from the bucket."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.test_family_hunyuan3d import object_png
from tests.integration.test_meshes_api import _wait
from tests.integration.test_shared_stores import _start_all, _wait_log
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold

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

    a, b = replica("a"), replica("b")
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
            held = on_a.post("/v1/meshes", files=image, data={**fields, "prompt": StepHold.MARKER}).json()
            _wait_log(a, f"fault injection: holding denoising step 2/{STEPS}")
            assert on_b.post(f"/v1/meshes/{held['id']}/cancel").json()["status"] == "cancelled"
            _wait_log(a, f"mesh job {held['id']} was finished or deleted through another replica")
            hold.release()
            _wait_log(a, f"stopped at step 2/{STEPS}")
            for client in (on_a, on_b):
                job = client.get(f"/v1/meshes/{held['id']}").json()
                assert job["status"] == "cancelled" and job["progress"] < 100, job
            assert "(notified)" in a.log(), "PostgreSQL's notification told A"
    finally:
        hold.release()
        a.stop()
        b.stop()
