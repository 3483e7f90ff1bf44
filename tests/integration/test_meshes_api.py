"""`/v1/meshes` (SGLang-Diffusion's mesh job API) against a real server on the tiny Hunyuan3D-2 release: four jobs
with equal steps / guidance / octree run as ONE DiT batch and each equals its solo in-process run; GLB is a real
GLB, OBJ is text; errors name the field and keep no job; list / get / cancel / delete; past --max-mesh-jobs
unfinished jobs a create is refused with 429. The official `openai` SDK has no meshes resource, so the test talks
httpx (as SGLang's clients do) and goes through the SDK's generic `client.get` / `client.post` once each."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest

from tests.integration.helpers import metric_value
from tests.integration.test_family_hunyuan3d import object_png
from tests.step_hold import StepHold


@pytest.fixture(scope="module")
def mesh_hold(tmp_path_factory) -> StepHold:
    """Mesh jobs whose prompt carries StepHold.MARKER wait at their DiT steps while armed."""
    hold = StepHold(tmp_path_factory.mktemp("mesh-hold"))
    hold.release()
    return hold


@pytest.fixture(scope="module")
def mesh_server(tiny_checkpoint, tmp_path_factory, mesh_hold):
    from tests.serverproc import ServerProcess

    logs = tmp_path_factory.mktemp("meshes")
    # A long batching delay: the head job waits for the other three, so the batch closes on max_size.
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_checkpoint("hunyuan3d")),
            "--served-model-name",
            "tiny-h3d",
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "4",
            "--batching-delay-ms",
            "4000",
            "--enable-batching-metrics",
            "--max-octree-resolution",
            "64",
            "--max-mesh-jobs",
            "4",
        ],
        logs / "server.log",
        env=mesh_hold.env(),
    )
    server.start(timeout_s=180)
    yield server
    server.stop()


def _wait(client: httpx.Client, job_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/meshes/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"mesh job {job_id} still {job['status']}")


def _create(client: httpx.Client, seed: int, **fields) -> dict:
    data = {"seed": str(seed), "num_inference_steps": "2", "octree_resolution": "24", **fields}
    reply = client.post("/v1/meshes", files={"image": ("object.png", object_png(), "image/png")}, data=data)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_four_jobs_run_as_one_batch_each_equal_to_solo(mesh_server, tiny_checkpoint):
    import trimesh

    from diffuserve.media.meshes import encode_mesh
    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    full = {"reason": "max_size"}
    max_size = metric_value(mesh_server.base_url, "diffuserve_batch_dispatches_total", full)
    with httpx.Client(base_url=mesh_server.base_url, timeout=30) as client:
        jobs = [_create(client, seed, prompt="ignored") for seed in (11, 12, 13, 14)]
        assert all(j["status"] == "queued" and j["object"] == "mesh" for j in jobs)
        done = [_wait(client, j["id"]) for j in jobs]
        assert [d["status"] for d in done] == ["completed"] * 4, done
        assert {d["timings"]["batch_size"] for d in done} == {4}
        assert {"encode", "denoise", "volume_decode", "marching_cubes"} <= set(done[0]["timings"]["stages_ms"])
        assert metric_value(mesh_server.base_url, "diffuserve_batch_dispatches_total", full) == max_size + 1
        pipe = load_pipeline(tiny_checkpoint("hunyuan3d"))
        for job in done:
            reply = client.get(f"/v1/meshes/{job['id']}/content")
            assert reply.headers["content-type"] == "model/gltf-binary" and reply.content[:4] == b"glTF"
            served = trimesh.load(io.BytesIO(reply.content), file_type="glb", force="mesh")
            solo = (
                pipe.run(
                    [
                        SamplingParams(
                            image_inputs=(object_png(),),
                            num_inference_steps=2,
                            guidance_scale=5.0,
                            seed=job["seed"],
                            octree_resolution=24,
                        )
                    ]
                )
                .outputs[0]
                .meshes[0]
            )
            alone = trimesh.load(
                io.BytesIO(encode_mesh(solo.vertices, solo.faces, "glb")), file_type="glb", force="mesh"
            )
            assert served.vertices.shape == alone.vertices.shape
            assert np.abs(np.asarray(served.vertices) - np.asarray(alone.vertices)).max() < 1e-4


def test_json_data_url_obj_and_job_lifecycle(mesh_server):
    import openai

    png = base64.b64encode(object_png()).decode()
    with httpx.Client(base_url=mesh_server.base_url, timeout=30) as client:
        reply = client.post(
            "/v1/meshes",
            json={
                "input_image": f"data:image/png;base64,{png}",
                "output_format": "obj",
                "seed": 3,
                "num_inference_steps": 2,
                "octree_resolution": 24,
            },
        )
        assert reply.status_code == 200, reply.text
        job = _wait(client, reply.json()["id"])
        assert job["status"] == "completed" and job["num_faces"] > 0
        content = client.get(f"/v1/meshes/{job['id']}/content")
        assert content.headers["content-type"].startswith("text/plain") and b"\nv " in content.content
        cancel = client.post(f"/v1/meshes/{job['id']}/cancel")
        assert cancel.status_code == 409 and cancel.json()["error"]["param"] == "mesh_id"
        sdk = openai.OpenAI(base_url=f"{mesh_server.base_url}/v1", api_key="unused")
        listed = sdk.get("/meshes", cast_to=object)
        assert job["id"] in [j["id"] for j in listed["data"]]
        assert client.delete(f"/v1/meshes/{job['id']}").json()["deleted"] is True
        assert client.get(f"/v1/meshes/{job['id']}").status_code == 404
        # A queued job (the head waits up to the batching delay for company) is cancelled before it runs.
        queued = _create(client, 5)
        cancelled = client.post(f"/v1/meshes/{queued['id']}/cancel").json()
        assert cancelled["status"] == "cancelled" and cancelled["error"]["code"]


@pytest.mark.parametrize(
    "kind, param",
    [
        ("none", "image"),
        ("two", "image"),
        ("not_image", "input_image"),
        ("remote", "input_image"),  # http(s) only with --allow-remote-urls (server/media_sources.py)
        ("file_id", "input_image"),
        ("format", "output_format"),
        ("octree", "octree_resolution"),
    ],
)
def test_rejected_creates_name_the_field_and_keep_no_job(mesh_server, kind, param):
    png = base64.b64encode(object_png()).decode()
    body = {"input_image": f"data:image/png;base64,{png}", "seed": 1}
    with httpx.Client(base_url=mesh_server.base_url, timeout=30) as client:
        before = client.get("/v1/meshes", params={"limit": 100}).json()["data"]
        if kind == "two":
            reply = client.post(
                "/v1/meshes",
                files=[
                    ("image", ("a.png", object_png(), "image/png")),
                    ("image", ("b.png", object_png(), "image/png")),
                ],
            )
        else:
            body = {
                "none": {"seed": 1},
                "not_image": {**body, "input_image": "data:image/png;base64,AAAA"},
                "remote": {**body, "input_image": "http://169.254.169.254/latest/meta-data/"},
                "file_id": {**body, "input_image": {"file_id": "file_1"}},
                "format": {**body, "output_format": "stl"},
                "octree": {**body, "octree_resolution": 65},
            }[kind]
            reply = client.post("/v1/meshes", json=body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param
        assert client.get("/v1/meshes", params={"limit": 100}).json()["data"] == before


def test_image_and_video_routes_point_to_meshes(mesh_server):
    with httpx.Client(base_url=mesh_server.base_url, timeout=30) as client:
        for route, body in (("/v1/images/generations", {"prompt": "a cat"}), ("/v1/videos", {"prompt": "a cat"})):
            reply = client.post(route, json=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "model", reply.text
            assert "/v1/meshes" in reply.json()["error"]["message"]
            assert "makes meshes" in reply.json()["error"]["message"], reply.text


def test_a_job_with_defaults_reports_the_values_it_runs_with(mesh_server):
    """Issue 34: `octree_resolution` left unset was reported as 0. Now the job shows what it runs with, the
    checkpoint's defaults (the tiny checkpoint's config.yaml suggests 2 steps and octree 32)."""
    with httpx.Client(base_url=mesh_server.base_url, timeout=30) as client:
        reply = client.post("/v1/meshes", files={"image": ("object.png", object_png(), "image/png")})
        assert reply.status_code == 200, reply.text
        assert (reply.json()["octree_resolution"], reply.json()["num_inference_steps"]) == (32, 2), reply.json()
        job = _wait(client, reply.json()["id"])
    assert job["status"] == "completed" and job["progress"] == 100, job
    assert (job["octree_resolution"], job["num_inference_steps"]) == (32, 2), job


def test_past_max_mesh_jobs_a_create_is_refused_429(mesh_server, mesh_hold):
    import openai

    sdk = openai.OpenAI(base_url=f"{mesh_server.base_url}/v1", api_key="unused", max_retries=0)
    png = base64.b64encode(object_png()).decode()
    body = {"input_image": f"data:image/png;base64,{png}", "seed": 1, "num_inference_steps": 2, "octree_resolution": 24}
    with httpx.Client(base_url=mesh_server.base_url, timeout=30) as client:
        mesh_hold.arm()  # the four jobs cannot finish until released: all four stay unfinished
        try:
            held = [_create(client, seed, prompt=f"held {StepHold.MARKER}") for seed in (21, 22, 23, 24)]
            before = client.get("/v1/meshes", params={"limit": 100}).json()["data"]
            with pytest.raises(openai.RateLimitError) as refused:
                sdk.post("/meshes", body=body, cast_to=object)
            assert refused.value.status_code == 429 and refused.value.code == "too_many_mesh_jobs"
            assert "--max-mesh-jobs" in refused.value.message
            assert int(refused.value.response.headers["retry-after"]) >= 1
            assert client.get("/v1/meshes", params={"limit": 100}).json()["data"] == before, "no job kept"
        finally:
            mesh_hold.release()
        assert [_wait(client, j["id"])["status"] for j in held] == ["completed"] * 4
        # Room again once they finished (the finished ones are kept, within the cap, oldest dropped first).
        again = sdk.post("/meshes", body=body, cast_to=object)
        assert _wait(client, again["id"])["status"] == "completed"
