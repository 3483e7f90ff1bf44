"""The video job store alone (transitions, bounds, listing) and the request checks that need no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import InvalidRequestError, ModelNotFoundError
from diffuserve.family_spec.base import SamplingDefaults
from diffuserve.sampling import ModelDescription
from diffuserve.server.video_jobs import VideoJob, VideoJobStore
from diffuserve.storage import ResultStore


def _store(tmp_path, max_jobs: int) -> VideoJobStore:
    return VideoJobStore(ResultStore(tmp_path / "results"), max_jobs)


def _job(i: int) -> VideoJob:
    return VideoJob(
        id=f"video_{i}",
        model="m",
        prompt=f"p{i}",
        width=32,
        height=32,
        num_frames=5,
        fps=8,
        num_inference_steps=4,
        seed=i,
        created_at=1000 + i,
    )


def test_lifecycle_queued_progress_completed_is_final(tmp_path):
    store = _store(tmp_path, 4)
    job = _job(1)
    store.add(job)
    assert job.to_dict()["status"] == "queued" and job.progress == 0 and job.seconds == "0.625"
    assert store.set_progress("video_1", 1, 4) and job.status == "in_progress" and job.progress == 25
    store.set_progress("video_1", 0, 4)  # a stale report never moves progress back
    assert job.progress == 25
    store.set_progress("video_1", 4, 4)
    assert job.progress == 99, "100 is kept for completed: decode and encode still follow"
    assert store.complete("video_1", b"mp4", {"batch_size": 1})
    assert job.status == "completed" and job.progress == 100 and store.content(job) == b"mp4" and job.completed_at
    # Nothing changes a finished job.
    assert not store.cancel("video_1") and not store.fail("video_1", {"message": "x"})
    assert not store.set_progress("video_1", 1, 4)
    assert job.status == "completed" and job.to_dict()["timings"] == {"batch_size": 1}


def test_cancelled_job_drops_a_late_result_and_failed_keeps_its_error(tmp_path):
    store = _store(tmp_path, 4)
    store.add(_job(1))
    store.add(_job(2))
    assert store.cancel("video_1", {"message": "cancelled", "type": "server_error", "param": None, "code": "cancelled"})
    assert not store.complete("video_1", b"late", {})
    assert store.get("video_1").status == "cancelled" and store.content(store.get("video_1")) is None
    error = {"message": "boom", "type": "server_error", "param": None, "code": "generation_failed"}
    assert store.fail("video_2", error)
    assert store.get("video_2").to_dict()["error"] == error
    assert not store.set_progress("nope", 1, 2) and store.get("nope") is None


def test_bound_drops_oldest_finished_never_live_jobs(tmp_path):
    store = _store(tmp_path, 3)
    for i in range(3):
        store.add(_job(i))
    store.complete("video_1", b"x", {})
    store.fail("video_2", {"message": "x"})
    # Over the cap: the oldest *finished* job goes (video_1), not the older but queued video_0.
    assert store.add(_job(3)) == ["video_1"]
    assert store.add(_job(4)) == ["video_2"]
    # Every kept job is live now: the store grows past the cap rather than drop one.
    assert store.add(_job(5)) == [] and len(store) == 4
    assert store.get("video_0") is not None
    with pytest.raises(KeyError):
        store.add(_job(5))


def test_list_newest_first_with_cursor_and_remove(tmp_path):
    store = _store(tmp_path, 10)
    for i in range(5):
        store.add(_job(i))
    page, more = store.list(limit=2)
    assert [j.id for j in page] == ["video_4", "video_3"] and more
    page, more = store.list(limit=2, after="video_3")
    assert [j.id for j in page] == ["video_2", "video_1"] and more
    page, more = store.list(limit=2, after="video_1")
    assert [j.id for j in page] == ["video_0"] and not more
    with pytest.raises(KeyError):
        store.list(after="missing")
    assert store.remove("video_2").id == "video_2" and store.remove("video_2") is None
    assert [j.id for j in store.list(limit=10)[0]] == ["video_4", "video_3", "video_1", "video_0"]
    with pytest.raises(ValueError):
        VideoJobStore(ResultStore(tmp_path / "results"), 0)


def _ctx(output_kind: str) -> SimpleNamespace:
    model = ModelDescription(
        output_kind=output_kind,
        defaults=SamplingDefaults(width=32, height=32, num_frames=5, fps=8),
        frame_multiple=4,
    )
    return SimpleNamespace(
        args=ServerArgs(served_model_name="m", max_video_frames=33), engine=SimpleNamespace(model=model)
    )


def test_build_params_refuses_image_models_and_maps_seconds_to_frames():
    from diffuserve.server.openai_videos import VideoCreateRequest, build_video_params

    with pytest.raises(InvalidRequestError) as refused:
        build_video_params(VideoCreateRequest(prompt="x"), _ctx("image"))
    assert refused.value.param == "model" and "makes images" in refused.value.message
    video = _ctx("video")
    params = build_video_params(VideoCreateRequest(prompt="x"), video)
    assert (params.num_frames, params.fps, params.output_format) == (5, 8, "mp4")
    # 2 s at 8 fps = 16 frames, snapped to the nearest 4k+1.
    assert build_video_params(VideoCreateRequest(prompt="x", seconds="2"), video).num_frames == 17
    assert build_video_params(VideoCreateRequest(prompt="x", seconds=1, fps=16), video).num_frames == 17
    # Both given (SGLang's and FastVideo's clients send both): an explicit num_frames wins; seconds must still be a
    # number.
    assert build_video_params(VideoCreateRequest(prompt="x", seconds="2", num_frames=9), video).num_frames == 9
    for body, param in (
        ({"seconds": "soon", "num_frames": 9}, "seconds"),
        ({"seconds": "soon"}, "seconds"),
        ({"num_frames": 37}, "num_frames"),
    ):
        with pytest.raises(InvalidRequestError) as bad:
            build_video_params(VideoCreateRequest(prompt="x", **body), video)
        assert bad.value.param == param, body
    with pytest.raises(ModelNotFoundError) as unknown:  # 404 model_not_found, as OpenAI answers
        build_video_params(VideoCreateRequest(prompt="x", model="other"), video)
    assert unknown.value.param == "model" and unknown.value.http_status == 404


def test_a_finished_job_is_recorded_once_the_store_answers_again(tmp_path, monkeypatch):
    from diffuserve.server import video_jobs
    from diffuserve.storage.media import StoreUnavailableError

    monkeypatch.setattr(video_jobs, "FINISH_RETRIES_S", (0.0, 0.0))
    store = _store(tmp_path, 4)
    store.add(_job(1))
    real, calls = store.results.finish, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise StoreUnavailableError("The results database (--results-db x) is unavailable: down.")
        return real(*args, **kwargs)

    monkeypatch.setattr(store.results, "finish", flaky)
    assert store.complete("video_1", b"mp4", {}) and len(calls) == 3
    assert store.get("video_1").status == "completed"
    store.add(_job(2))
    # Every attempt fails now: after the retries the error reaches the caller.
    monkeypatch.setattr(store.results, "finish", lambda *a, **k: (_ for _ in ()).throw(StoreUnavailableError("down")))
    with pytest.raises(StoreUnavailableError):
        store.complete("video_2", b"mp4", {})
