"""Streaming partial images (the OpenAI images API's Server-Sent Events) and the other OpenAI request
fields, through the official SDK against one shared server (tiny FLUX, dynamic batching, API key)."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.conftest import STREAMING_API_KEY
from tests.integration.helpers import metric_value, stopped_batches, wait_batch_stopped
from tests.step_hold import StepHold, wait_idle

HEADERS = {"Authorization": f"Bearer {STREAMING_API_KEY}"}


@pytest.fixture(scope="module")
def client(streaming_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{streaming_server.base_url}/v1", api_key=STREAMING_API_KEY, max_retries=0)


def _image(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(_image(b64).convert("RGB"), dtype=np.int16)


def test_sdk_generate_streams_partials_then_one_completed_per_image(client, streaming_server):
    events = list(
        client.images.generate(
            model="tiny-flux-stream",
            prompt="a red fox",
            n=2,
            size="64x64",
            stream=True,
            partial_images=2,
            extra_body={"num_inference_steps": 4, "seed": 7},
        )
    )
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 4 + ["image_generation.completed"] * 2, kinds
    partials = [e for e in events if e.type.endswith("partial_image")]
    # Each of the n images streams its own previews (steps 1 and 3 of 4), then its own final image.
    assert sorted((e.output_index, e.partial_image_index) for e in partials) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for event in events:
        assert (event.size, event.output_format, event.background, event.quality) == ("64x64", "png", "opaque", "auto")
        assert event.created_at > 0 and _image(event.b64_json).size == (64, 64)
    completed = [e for e in events if e.type.endswith("completed")]
    assert [e.output_index for e in completed] == [0, 1]
    usage = completed[0].usage
    assert usage.output_tokens == 2 * (64 // 16) ** 2 and usage.input_tokens_details.text_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The streamed finals equal the plain response for the same seed; previews are earlier estimates.
    plain = client.images.generate(
        model="tiny-flux-stream",
        prompt="a red fox",
        n=2,
        size="64x64",
        extra_body={"num_inference_steps": 4, "seed": 7},
    )
    for event, data in zip(completed, plain.data, strict=True):
        assert np.array_equal(_pixels(event.b64_json), _pixels(data.b64_json))
    first_preview = next(e for e in partials if e.output_index == 0 and e.partial_image_index == 0)
    assert not np.array_equal(_pixels(first_preview.b64_json), _pixels(completed[0].b64_json))
    assert plain.usage.total_tokens == usage.total_tokens and plain.quality == "auto"


def test_concurrent_streams_batch_and_each_gets_its_own_events(client, streaming_server):
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = list(
            client.images.generate(
                prompt=f"stream {i}",
                size="64x64",
                stream=True,
                partial_images=1,
                extra_body={"num_inference_steps": 3, "seed": 100 + i},
            )
        )

    merged = metric_value(streaming_server.base_url, "diffuserve_batch_merged_dispatches_total", headers=HEADERS)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == [0, 1]
    for events in results.values():
        assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    merged_now = metric_value(streaming_server.base_url, "diffuserve_batch_merged_dispatches_total", headers=HEADERS)
    assert merged_now == merged + 1, "the two streaming requests ran as one batch"
    assert not np.array_equal(_pixels(results[0][1].b64_json), _pixels(results[1][1].b64_json))


def test_sdk_edit_streams_image_edit_events(client):
    source = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(source, format="PNG")
    events = list(
        client.images.edit(
            image=("in.png", source.getvalue(), "image/png"),
            prompt="make it blue",
            stream=True,
            partial_images=1,
            size="64x64",
            extra_body={"num_inference_steps": 4, "seed": 3, "strength": 1.0},
        )
    )
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert _image(events[-1].b64_json).size == (64, 64)
    assert events[-1].usage.input_tokens_details.image_tokens == (64 // 16) ** 2


def test_disconnect_mid_stream_cancels_the_row(streaming_server):
    base = streaming_server.base_url
    cancelled = metric_value(base, "diffuserve_requests_total", {"status": "cancelled"}, headers=HEADERS)
    stopped = stopped_batches(base, HEADERS)
    # The run may go up to its first preview, then it is held until the disconnect was seen: on any machine the
    # client leaves mid-run.
    from diffuserve.executor.batch_runner import preview_steps

    hold = StepHold(streaming_server.log_path.parent)
    hold.arm()
    wait_idle(streaming_server, HEADERS)
    hold.release(steps=preview_steps(400, 3)[0] + 1)
    body = {
        "prompt": f"long {StepHold.MARKER}",
        "size": "64x64",
        "stream": True,
        "partial_images": 3,
        "num_inference_steps": 400,
        "seed": 1,
    }
    with httpx.stream("POST", f"{base}/v1/images/generations", json=body, headers=HEADERS, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: image_generation.partial_image"):
                break  # one preview arrived: the request is running; now go away
    deadline = time.monotonic() + 30
    try:
        while metric_value(base, "diffuserve_requests_total", {"status": "cancelled"}, headers=HEADERS) <= cancelled:
            assert time.monotonic() < deadline, streaming_server.log()[-2000:]
            time.sleep(0.05)
    finally:
        hold.release()
    assert wait_batch_stopped(base, stopped, HEADERS) < 400, "the batch stopped"


def test_stream_errors_after_admission_are_error_events_and_before_it_json(streaming_server, client):
    bad = httpx.post(
        f"{streaming_server.base_url}/v1/images/generations",
        headers=HEADERS,
        timeout=30,
        json={"prompt": "x", "stream": True, "partial_images": 4},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "partial_images"
    with pytest.raises(openai.APIError, match="deadline"):
        list(
            client.images.generate(
                prompt="slow",
                size="64x64",
                stream=True,
                partial_images=0,
                extra_body={"num_inference_steps": 400, "timeout": 0.3},
            )
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": "transparent"}, "background"),
        ({"background": "glass"}, "background"),
        ({"output_compression": 50}, "output_compression"),  # png is lossless
        ({"output_compression": 101, "output_format": "jpeg"}, "output_compression"),
        ({"output_compression": 50, "output_quality": 80, "output_format": "jpeg"}, "output_compression"),
        ({"quality": "ultra"}, "quality"),
        ({"moderation": "none"}, "moderation"),
        ({"partial_images": 1}, "partial_images"),  # needs stream
    ],
)
def test_openai_fields_refused_name_the_field(streaming_server, body, param):
    response = httpx.post(
        f"{streaming_server.base_url}/v1/images/generations",
        headers=HEADERS,
        timeout=30,
        json={"prompt": "x", "size": "64x64", **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_openai_fields_accepted_and_honest(client):
    common = {"prompt": "a lighthouse", "model": "tiny-flux-stream"}
    auto = client.images.generate(
        size="auto", background="auto", moderation="low", **common, extra_body={"num_inference_steps": 2, "seed": 5}
    )
    assert auto.size == "64x64" and auto.background == "opaque", "size auto = the family default"
    assert auto.usage.output_tokens == (64 // 16) ** 2
    # quality maps to steps: medium = half of the family's default 28 = 14 steps.
    medium = client.images.generate(size="64x64", quality="medium", **common, extra_body={"seed": 5})
    fourteen = client.images.generate(size="64x64", **common, extra_body={"seed": 5, "num_inference_steps": 14})
    full = client.images.generate(size="64x64", quality="high", **common, extra_body={"seed": 5})
    assert medium.quality == "medium"
    assert np.array_equal(_pixels(medium.data[0].b64_json), _pixels(fourteen.data[0].b64_json))
    assert not np.array_equal(_pixels(medium.data[0].b64_json), _pixels(full.data[0].b64_json))
    # output_compression drives the jpeg encoder: more compression, fewer bytes.
    sizes = {}
    for compression in (5, 95):
        result = client.images.generate(
            size="64x64",
            output_format="jpeg",
            output_compression=compression,
            **common,
            extra_body={"seed": 5, "num_inference_steps": 2},
        )
        sizes[compression] = len(base64.b64decode(result.data[0].b64_json))
        assert _image(result.data[0].b64_json).format == "JPEG"
    assert sizes[5] < sizes[95]
