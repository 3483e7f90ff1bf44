"""Image edits (image-to-image): fidelity against diffusers, the multipart API, never merged."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from diffuserve.models.loader import load_pipeline
from diffuserve.sampling import SamplingParams
from tests.integration.helpers import decode_b64_png, metric_value, pixels
from tests.step_hold import StepHold, running, wait_idle


def _png(width: int = 48, height: int = 64, seed: int = 0) -> bytes:
    array = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("n", [1, 2])
def test_native_img2img_matches_diffusers(tiny_flux_path: Path, n: int):
    from diffusers import FluxImg2ImgPipeline

    source = _png()
    native = load_pipeline(tiny_flux_path)
    params = SamplingParams(
        prompt="a fox",
        width=48,
        height=64,
        num_inference_steps=4,
        seed=3,
        n=n,
        strength=0.6,
        image_inputs=(source,),
        guidance_scale=3.5,
    )
    ours = native.run([params]).outputs[0].images
    reference = FluxImg2ImgPipeline.from_pretrained(tiny_flux_path, local_files_only=True)
    theirs = reference(
        prompt="a fox",
        image=Image.open(io.BytesIO(source)),
        height=64,
        width=48,
        num_inference_steps=4,
        strength=0.6,
        guidance_scale=3.5,
        num_images_per_prompt=n,
        max_sequence_length=reference.tokenizer_2.model_max_length,
        generator=[torch.Generator().manual_seed(3 + j) for j in range(n)],
    ).images
    assert len(ours) == len(theirs) == n
    for a, b in zip(ours, theirs, strict=True):
        assert np.abs(pixels(a) - pixels(b)).max() <= 1  # tolerance 1/255 per pixel (observed 0)


def test_openai_client_edit(singleton_server):
    client = openai.OpenAI(base_url=f"{singleton_server.base_url}/v1", api_key="unused", max_retries=0)
    result = client.images.edit(
        image=("in.png", _png(), "image/png"),
        prompt="make it blue",
        n=2,
        size="64x64",
        extra_body={"strength": 0.5, "seed": 4, "num_inference_steps": 4},
    )
    images = [decode_b64_png(d.b64_json) for d in result.data]
    assert len(images) == 2 and all(im.size == (64, 64) for im in images)
    # Without a size the output takes the input's size (rounded to the model's multiple of 16).
    default = httpx.post(
        f"{singleton_server.base_url}/v1/images/edits",
        files={"image": ("in.png", _png(50, 70))},
        data={"prompt": "same size", "num_inference_steps": "2"},
        timeout=60,
    )
    assert default.status_code == 200 and default.json()["size"] == "48x64"


def test_more_images_than_the_family_takes_is_a_400_naming_image(singleton_server):
    """The SDK sends a list as repeated `image[]` parts; FLUX.1 img2img takes one, so two are refused."""
    client = openai.OpenAI(base_url=f"{singleton_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(
            image=[("a.png", _png(), "image/png"), ("b.png", _png(seed=1), "image/png")], prompt="two", size="64x64"
        )
    error = err.value.body
    assert error["param"] == "image" and "exactly one" in error["message"] and "got 2" in error["message"]


def test_edit_strength_keeps_the_input(singleton_server):
    """Low strength stays closer to the input image than full strength does."""
    source = _png(64, 64, seed=5)

    def edit(strength: str) -> np.ndarray:
        response = httpx.post(
            f"{singleton_server.base_url}/v1/images/edits",
            files={"image": ("in.png", source)},
            data={"prompt": "p", "strength": strength, "num_inference_steps": "10", "seed": "1"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return pixels(decode_b64_png(response.json()["data"][0]["b64_json"]))

    original = pixels(Image.open(io.BytesIO(source)))
    assert np.abs(edit("0.2") - original).mean() < np.abs(edit("1.0") - original).mean()


@pytest.mark.parametrize(
    ("files", "data", "param"),
    [
        ({"image": ("in.png", b"not an image")}, {"prompt": "x"}, "image"),
        ({}, {"prompt": "x"}, "image"),
        ({"image": ("in.png", _png()), "mask": ("m.png", _png(32, 32))}, {"prompt": "x"}, "mask"),  # other size
        ({"image": ("in.png", _png())}, {"prompt": "x", "strength": "0"}, "strength"),
        ({"image": ("in.png", _png())}, {"prompt": "x", "strength": "0.1", "num_inference_steps": "4"}, "strength"),
        ({"image": ("in.png", _png())}, {"prompt": "x", "n": "eleven"}, "n"),
        ({"image": ("in.png", _png())}, {"prompt": "x", "unknown_field": "1"}, "unknown_field"),
        ({"image": ("in.png", _png())}, {}, "prompt"),
        ({"image": ("in.png", _png()), "other": ("x", b"1")}, {"prompt": "x"}, "other"),  # a stray file is named
        ({}, {"prompt": "x", "url": "data:image/png;base64,@@"}, "url"),  # form-urlencoded url source
    ],
)
def test_bad_edits_get_400_naming_the_field(singleton_server, files, data, param):
    response = httpx.post(f"{singleton_server.base_url}/v1/images/edits", files=files or None, data=data, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_edit_bodies_of_other_types_name_the_body(singleton_server):
    # Multipart, form-urlencoded and JSON are edit bodies (docs/api.md, "Image sources by URL"); others are not.
    route = f"{singleton_server.base_url}/v1/images/edits"
    for response, param in (
        (httpx.post(route, content=b"prompt=x", headers={"Content-Type": "text/plain"}), "body"),
        (httpx.post(route, content=b"{not json", headers={"Content-Type": "application/json"}), "body"),
        (httpx.post(route, json=["a list"]), "body"),
        (httpx.post(route, json={"prompt": "x"}), "image"),  # JSON without `images`
        (httpx.post(route, json={"prompt": "x", "images": [{"file_id": "file_1"}]}), "images"),
    ):
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_edits_are_never_merged(dynamic_server):
    head_reason = {"reason": "head:image_conditioning"}
    alone = metric_value(dynamic_server.base_url, "diffuserve_batch_dispatches_total", head_reason)
    before = metric_value(
        dynamic_server.base_url, "diffuserve_batching_rejects_total", {"reason": "image_conditioning"}
    )

    def edit(i: int) -> httpx.Response:
        return httpx.post(
            f"{dynamic_server.base_url}/v1/images/edits",
            files={"image": ("in.png", _png(64, 64, i))},
            data={"prompt": f"edit {i}", "size": "64x64", "num_inference_steps": "3", "seed": str(i)},
            timeout=120,
        )

    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(edit, range(3)))
    assert [r.status_code for r in responses] == [200] * 3
    assert [r.json()["timings"]["batch_size"] for r in responses] == [1, 1, 1]
    # An edit at the head of the queue is dispatched alone (stop reason head:image_conditioning; size 1 above).
    assert metric_value(dynamic_server.base_url, "diffuserve_batch_dispatches_total", head_reason) >= alone + 1
    # A generation waiting for company as head leaves a queued edit out, counted as image_conditioning. A held
    # request runs meanwhile, so both are in the queue (head first) when the head's batch forms, on any machine.
    hold = StepHold(dynamic_server.log_path.parent)
    hold.arm()
    wait_idle(dynamic_server)
    with ThreadPoolExecutor(3) as pool:
        try:
            held = pool.submit(
                httpx.post,
                f"{dynamic_server.base_url}/v1/images/generations",
                timeout=120,
                json={"prompt": f"held {StepHold.MARKER}", "size": "32x32", "num_inference_steps": 2},
            )
            _wait(lambda: running(dynamic_server))
            generation = pool.submit(
                httpx.post,
                f"{dynamic_server.base_url}/v1/images/generations",
                timeout=120,
                json={"prompt": "head", "size": "64x64", "num_inference_steps": 3},
            )
            _wait(lambda: metric_value(dynamic_server.base_url, "diffuserve_queue_depth") == 1)
            edited = pool.submit(edit, 7)
            _wait(lambda: metric_value(dynamic_server.base_url, "diffuserve_queue_depth") == 2)
        finally:
            hold.release()
        assert held.result().status_code == 200
        assert generation.result().status_code == 200 and edited.result().status_code == 200
    after = metric_value(dynamic_server.base_url, "diffuserve_batching_rejects_total", {"reason": "image_conditioning"})
    assert after > before


def _wait(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        time.sleep(0.05)
