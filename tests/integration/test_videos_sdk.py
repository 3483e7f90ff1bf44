"""The video API as the official `openai` SDK speaks it: its own methods, unmodified (create, create_and_poll,
retrieve, list, delete, download_content, remix), on a tiny Wan text-to-video server and a tiny Wan
image-to-video server. The SDK marks these methods deprecated (the hosted service closed); the wire contract
is what servers and clients still use, so the warning is filtered here."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from diffuserve.media.video import probe_mp4
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _png(seed: int = 0, size: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def i2v_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("i2v")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_checkpoint("wan-i2v")),
            "--served-model-name",
            "tiny-wan-i2v",
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "2",
        ],
        logs / "server.log",
    )
    server.start()
    yield server
    server.stop()


def _job_count(server: ServerProcess) -> int:
    return len(httpx.get(f"{server.base_url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"])


def test_create_and_poll_then_every_variant(wan_server):
    client = _client(wan_server)
    video = client.videos.create_and_poll(prompt="a red fox", seconds="1", size="32x32")
    assert video.status == "completed" and video.size == "32x32"
    raw = client.videos.with_raw_response.retrieve(video.id)
    assert raw.parse().id == video.id and "openai-poll-after-ms" not in raw.headers  # finished: no poll hint
    mp4 = client.videos.download_content(video.id).read()
    info = probe_mp4(mp4)
    assert (info["width"], info["height"]) == (32, 32) and info["frames"] == 9  # 1 s at 8 fps -> 4k+1 = 9
    thumb = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumb.format == "WEBP" and thumb.size == (32, 32)
    sheet = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="spritesheet").read()))
    assert sheet.format == "JPEG" and sheet.size == (4 * 32, 3 * 32)  # 9 frames in rows of 4
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.download_content(video.id, variant="gif")  # type: ignore[arg-type]
    assert err.value.body["param"] == "variant"


def test_queued_jobs_carry_the_poll_header(wan_server):
    client = _client(wan_server)
    raw = client.videos.with_raw_response.create(
        prompt="a slow kite", size="32x32", extra_body={"num_inference_steps": 40}
    )
    job = raw.parse()
    assert raw.headers["openai-poll-after-ms"] == "500"
    assert client.videos.poll(job.id).status == "completed"


def test_list_pages_in_both_orders_and_delete(wan_server):
    client = _client(wan_server)
    ids = [client.videos.create_and_poll(prompt=f"clip {i}", size="32x32").id for i in range(3)]
    newest = client.videos.list(limit=2)
    assert [v.id for v in newest.data][:2] == ids[::-1][:2] and newest.has_more
    after = client.videos.list(limit=1, after=newest.data[-1].id)
    assert after.data[0].id == ids[0]
    oldest = [v.id for v in client.videos.list(limit=100, order="asc").data]
    assert [i for i in oldest if i in ids] == ids
    deleted = client.videos.delete(ids[1])
    assert deleted.deleted and deleted.id == ids[1]
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(ids[1])


def test_remix_keeps_the_settings_with_a_new_prompt(wan_server):
    client = _client(wan_server)
    source = client.videos.create_and_poll(
        prompt="a red fox", size="48x32", seconds="1", extra_body={"seed": 7, "num_inference_steps": 3}
    )
    remix = client.videos.remix(source.id, prompt="a blue fox")
    assert remix.prompt == "a blue fox" and remix.remixed_from_video_id == source.id
    done = client.videos.poll(remix.id)
    assert done.status == "completed" and (done.size, done.seconds) == (source.size, source.seconds)
    as_dict = httpx.get(f"{wan_server.base_url}/v1/videos/{remix.id}", timeout=30).json()
    assert (as_dict["seed"], as_dict["num_inference_steps"]) == (7, 3)


def test_text_to_video_model_refuses_an_image_and_keeps_no_job(wan_server):
    client = _client(wan_server)
    before = _job_count(wan_server)
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="x", size="32x32", input_reference=("in.png", _png(), "image/png"))
    assert err.value.body["param"] == "input_reference"
    for bad in (
        {"prompt": "x", "num_frames": 4},
        {"prompt": "x", "size": "1024x1024"},
        {"prompt": "x", "num_frames": 10_001},
    ):
        assert httpx.post(f"{wan_server.base_url}/v1/videos", json=bad, timeout=30).status_code == 400
    assert _job_count(wan_server) == before  # every rejected create left nothing behind


def test_image_to_video_with_an_upload_and_a_data_url(i2v_server):
    client = _client(i2v_server)
    uploaded = client.videos.create(
        prompt="the cat walks", size="32x32", input_reference=("in.png", _png(3), "image/png")
    )
    done = client.videos.poll(uploaded.id)
    assert done.status == "completed" and probe_mp4(client.videos.download_content(done.id).read())["frames"] >= 1
    data_url = "data:image/png;base64," + base64.b64encode(_png(4)).decode()
    reply = httpx.post(
        f"{i2v_server.base_url}/v1/videos",
        timeout=30,
        json={"prompt": "the dog runs", "size": "32x32", "input_reference": {"image_url": data_url}},
    )
    assert reply.status_code == 200, reply.text
    assert client.videos.poll(reply.json()["id"]).status == "completed"
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.remix(done.id, prompt="again")
    assert err.value.body["param"] == "video_id"  # the input image is not kept, so no remix


@pytest.mark.parametrize(
    ("reference", "needle"),
    [
        (None, "exactly one input image"),
        ({"image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}, "input_reference"),
        ({"image_url": "https://example.com/cat.png"}, "--allow-remote-urls"),
        ({"file_id": "file_123"}, "file_id"),
    ],
)
def test_bad_image_references_get_400_naming_input_reference(i2v_server, reference, needle):
    before = _job_count(i2v_server)
    body = {"prompt": "x", "size": "32x32", **({"input_reference": reference} if reference else {})}
    reply = httpx.post(f"{i2v_server.base_url}/v1/videos", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input_reference" and needle in error["message"]
    assert _job_count(i2v_server) == before
