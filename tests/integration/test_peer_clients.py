"""Clients of other diffusion servers, unchanged: the request fields SGLang-Diffusion's, vLLM-Omni's and FastVideo's
clients send through the official `openai` SDK's `extra_body` (docs/api.md, "Fields of other servers' clients"), and
the edit masks they send: SGLang's regression that an edit must not ignore its `mask`, vLLM-Omni's `mask_image`.

Each body below is shaped as that client sends it (field names and the way they travel); the shared tiny FLUX and
tiny Wan2.1 servers answer them (and the tiny LTX-2 server vLLM-Omni's sound fields). Edit sources given as URLs
(SGLang's `url` in `extra_body`, vLLM-Omni's `url` form fields, OpenAI's JSON `images`) are data: URLs here (http(s)
URLs and their guards: tests/integration/test_media_urls.py). What a field does is checked on the pipelines
themselves: `flow_shift` against diffusers with the same shift, Wan2.2 A14B's `boundary_ratio` against diffusers'
WanPipeline with that boundary, Qwen-Image-Layered's `resolution` reaching its `__call__` (the sound:
tests/integration/test_video_sound.py).
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from diffuserve.errors import InvalidRequestError
from diffuserve.media.video import probe_mp4
from diffuserve.models.loader import load_pipeline
from diffuserve.sampling import build_sampling_params, signature_difference
from tests.integration.family_checks import max_pixel_diff
from tests.integration.helpers import decode_b64_png, pixels
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks its video methods deprecated

# -- the bodies other servers' clients send (extra_body of the official SDK) -----------------------------------

SGLANG_IMAGE = {"num_frames": 1, "num_inference_steps": 2, "seed": 1, "guidance_scale": 3.5}
"""SGLang-Diffusion's image generation: every call carries num_frames (1 for an image)."""
SGLANG_EDIT = {"num_frames": 1, "num_inference_steps": 2, "seed": 2}
"""SGLang-Diffusion's image edit (multipart form fields beside `image`)."""
URL_EDIT_BODIES = {
    "sglang-url": "SDK multipart, `url` in extra_body beside no file (SGLang-Diffusion's client)",
    "vllm-omni-sdk": "SDK multipart, `image=[]` and a `url` list in extra_body: `url[]` parts (vLLM-Omni's docs)",
    "vllm-omni-form": "form-urlencoded `url` fields, no files (vLLM-Omni's own test client)",
    "openai-json": 'JSON `images: [{"image_url": ...}]` (OpenAI\'s JSON edit form)',
}
"""Edit bodies whose source image travels as a data: URL; each must edit exactly as the uploaded file does."""
VLLM_OMNI_IMAGE = {"num_inference_steps": 2, "seed": 3, "true_cfg_scale": 1.0, "flow_shift": 2.0}
"""vLLM-Omni's image generation with the scheduler's shift."""
SGLANG_VIDEO = {"num_frames": 5, "width": 32, "height": 32, "num_inference_steps": 2, "seed": 4}
"""SGLang-Diffusion's video job: `seconds` (a create argument) and num_frames together, width/height with size."""
FASTVIDEO_VIDEO = {"num_frames": 5, "num_inference_steps": 2, "seed": 5, "guidance_scale": 3.0, "flow_shift": 3.0}
"""FastVideo's video job: num_frames wins over seconds; flow_shift for Wan's flow-matching UniPC."""
VLLM_OMNI_VIDEO = {
    "num_frames": 9,
    "num_inference_steps": 2,
    "seed": 6,
    "generate_sound": True,
    "sound_duration": 1.125,
}
"""vLLM-Omni's video job with sound (its t2v_sound task): `generate_sound`, and `sound_duration` = the video's duration
(9 frames at the tiny LTX-2's 8 fps); models without sound refuse both, naming them."""
OTHER_EXTENSIONS = [
    ("embedded_cfg_scale", 6.0),
    ("cfg_normalize", True),
    ("use_en_prompt", False),
    ("sigmas", [1.0, 0.5]),
]
"""Extensions of those servers this one does not implement: each stays a 400 naming the field. (`enable_teacache`
is implemented, as `{"method": "teacache"}`: tests/integration/test_step_cache.py.)"""


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _png(width: int = 32, height: int = 32, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


# -- images and edits ---------------------------------------------------------------------------------------


def test_sglang_and_vllm_omni_image_bodies_work(singleton_server):
    client = _client(singleton_server)
    for body in (SGLANG_IMAGE, VLLM_OMNI_IMAGE):
        result = client.images.generate(prompt="a red fox", size="32x32", extra_body=body)
        assert decode_b64_png(result.data[0].b64_json).size == (32, 32)
    edit = client.images.edit(
        image=("in.png", _png(48, 32), "image/png"), prompt="make it blue", extra_body=SGLANG_EDIT
    )
    assert decode_b64_png(edit.data[0].b64_json).size == (48, 32)


def _url_edit(server: ServerProcess, shape: str, url: str) -> str:
    """The b64 image of an edit whose source is `url`, sent in the body shape `shape` (URL_EDIT_BODIES)."""
    client, route = _client(server), f"{server.base_url}/v1/images/edits"
    if shape == "sglang-url":
        return (
            client.images.edit(image=[], prompt="make it blue", extra_body={**SGLANG_EDIT, "url": url}).data[0].b64_json
        )
    if shape == "vllm-omni-sdk":
        return (
            client.images.edit(image=[], prompt="make it blue", extra_body={**SGLANG_EDIT, "url": [url]})
            .data[0]
            .b64_json
        )
    if shape == "vllm-omni-form":
        form = {"prompt": "make it blue", "url": [url], **{k: str(v) for k, v in SGLANG_EDIT.items()}}
        reply = httpx.post(route, data=form, timeout=120)
    else:
        reply = httpx.post(
            route, json={"prompt": "make it blue", "images": [{"image_url": url}], **SGLANG_EDIT}, timeout=120
        )
    assert reply.status_code == 200, reply.text
    return reply.json()["data"][0]["b64_json"]


def test_edit_sources_as_data_urls_in_every_peer_body(singleton_server):
    client = _client(singleton_server)
    png = _png(48, 32, seed=5)
    upload = client.images.edit(image=("in.png", png, "image/png"), prompt="make it blue", extra_body=SGLANG_EDIT)
    expected = pixels(decode_b64_png(upload.data[0].b64_json))
    for shape in URL_EDIT_BODIES:
        got = pixels(decode_b64_png(_url_edit(singleton_server, shape, _data_url(png))))
        assert got.shape == expected.shape and np.abs(got - expected).max() == 0, shape  # the same bytes, the same edit
    # Without --allow-remote-urls an http(s) source is a 400 naming the field that carried it, in every shape.
    remote = "http://169.254.169.254/latest/meta-data/"
    message = _refused(lambda: client.images.edit(image=[], prompt="x", extra_body={"url": remote}), "url")
    assert "--allow-remote-urls" in message
    reply = httpx.post(
        f"{singleton_server.base_url}/v1/images/edits",
        json={"prompt": "x", "images": [{"image_url": remote}]},
        timeout=30,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "images", reply.text
    # Too many sources for a one-image model: files and URLs count together.
    message = _refused(
        lambda: client.images.edit(image=("in.png", png, "image/png"), prompt="x", extra_body={"url": _data_url(png)}),
        "image",
    )
    assert "got 2" in message


def _mask_png(size: tuple[int, int] = (48, 32)) -> bytes:
    """OpenAI's mask: opaque, but a fully transparent box (repaint there)."""
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (8, 8, 40, 24))
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()


def test_sglang_mask_regression_an_edit_does_not_ignore_its_mask(singleton_server):
    """SGLang's regression test: /v1/images/edits with a mask must not answer as if the mask were absent (what each
    masked row must be, the diffusers inpaint pipeline's image, is tests/integration/test_masks.py's)."""
    client = _client(singleton_server)
    source = _png(48, 32, seed=3)
    body = {**SGLANG_EDIT, "num_inference_steps": 4, "strength": 0.9}

    def edit(**kw) -> np.ndarray:
        answer = client.images.edit(image=("in.png", source, "image/png"), prompt="a hat", extra_body=body, **kw)
        return pixels(decode_b64_png(answer.data[0].b64_json))

    plain, masked = edit(), edit(mask=("mask.png", _mask_png(), "image/png"))
    assert np.abs(plain - masked).max() > 8


def test_vllm_omni_mask_image_is_the_mask(singleton_server):
    """vLLM-Omni's clients name the mask `mask_image` and send it as base64 in the form (extra_body)."""
    client = _client(singleton_server)
    source = _png(48, 32, seed=4)
    encoded = base64.b64encode(_mask_png()).decode()
    results = [
        client.images.edit(
            image=("in.png", source, "image/png"), prompt="a hat", extra_body={**SGLANG_EDIT, **extra}, **kw
        )
        .data[0]
        .b64_json
        for extra, kw in (
            ({"mask_image": encoded}, {}),
            ({"mask_image": f"data:image/png;base64,{encoded}"}, {}),
            ({}, {"mask": ("mask.png", _mask_png(), "image/png")}),
        )
    ]
    assert results[0] == results[1] == results[2]


def test_flow_shift_changes_the_schedule(singleton_server):
    client = _client(singleton_server)
    body = {"num_inference_steps": 2, "seed": 9}
    plain, shifted = (
        decode_b64_png(client.images.generate(prompt="a fox", size="32x32", extra_body=extra).data[0].b64_json)
        for extra in (body, {**body, "flow_shift": 6.0})
    )
    assert np.abs(pixels(plain) - pixels(shifted)).max() > 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"num_frames": 2}, "num_frames"),
        ({"layers": 2}, "layers"),  # not a layered model
        ({"resolution": 640}, "resolution"),
        ({"flow_shift": 0}, "flow_shift"),
        ({"boundary_ratio": 0.5}, "boundary_ratio"),
        *[({name: value}, name) for name, value in OTHER_EXTENSIONS],
    ],
)
def test_image_fields_a_model_cannot_honour_are_400s_naming_them(singleton_server, extra, param):
    client = _client(singleton_server)
    _refused(
        lambda: client.images.generate(prompt="x", size="32x32", extra_body={"num_inference_steps": 1, **extra}), param
    )


def test_edit_num_frames_other_than_one_is_refused(singleton_server):
    client = _client(singleton_server)
    message = _refused(
        lambda: client.images.edit(image=("in.png", _png(), "image/png"), prompt="x", extra_body={"num_frames": 3}),
        "num_frames",
    )
    assert "only be 1" in message


# -- videos -------------------------------------------------------------------------------------------------


def test_sglang_video_body_num_frames_wins_over_seconds(wan_server):
    client = _client(wan_server)
    raw = client.videos.with_raw_response.create(prompt="a red fox", seconds="4", size="32x32", extra_body=SGLANG_VIDEO)
    job = raw.http_response.json()
    # 5 frames at the model's 8 fps: the job says what runs, and a warning says why seconds was not used.
    assert (job["num_frames"], job["seconds"], job["size"]) == (5, "0.625", "32x32")
    assert any("num_frames wins" in w for w in job["warnings"])
    done = client.videos.poll(job["id"])
    assert done.status == "completed", done


def test_fastvideo_body_and_width_height_instead_of_size(wan_server):
    client = _client(wan_server)
    job = client.videos.create(prompt="a cat", seconds="1", extra_body={**FASTVIDEO_VIDEO, "width": 48, "height": 32})
    assert (job.size, job.model_extra["num_frames"]) == ("48x32", 5)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"size": "32x32", "width": 48}, "width"),  # given together, size and width/height must agree
        ({"guidance_scale_2": 2.0}, "guidance_scale_2"),  # Wan2.1: one expert
        ({"boundary_ratio": 0.5}, "boundary_ratio"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),  # Wan runs classic CFG under guidance_scale
        ({"seconds": "soon", "num_frames": 5}, "seconds"),
        *[({name: value}, name) for name, value in OTHER_EXTENSIONS],
    ],
)
def test_video_fields_a_model_cannot_honour_are_400s_naming_them(wan_server, extra, param):
    response = httpx.post(f"{wan_server.base_url}/v1/videos", json={"prompt": "x", **extra}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_vllm_omni_video_body_with_sound_works_where_the_model_has_sound(ltx2_server):
    client = _client(ltx2_server)
    done = client.videos.poll(client.videos.create(prompt="a dog barks", size="32x32", extra_body=VLLM_OMNI_VIDEO).id)
    assert done.status == "completed", done
    info = probe_mp4(client.videos.download_content(done.id).read())
    assert (info["frames"], info["audio_streams"], info["audio"]["codec"]) == (9, 1, "aac")


@pytest.mark.parametrize("name", ["generate_sound", "sound_duration", "generate_audio"])
def test_sound_fields_are_refused_naming_them_where_the_model_makes_none(wan_server, name):
    client = _client(wan_server)
    value = {"generate_sound": True, "sound_duration": 0.625, "generate_audio": False}[name]
    message = _refused(lambda: client.videos.create(prompt="x", extra_body={"num_frames": 5, name: value}), name)
    assert "LTX-2" in message


# -- what the fields do, on the pipelines -------------------------------------------------------------------


def test_flow_shift_is_the_static_shift_diffusers_runs(tiny_flux_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = load_pipeline(tiny_flux_path)
    model = pipe.describe_model()
    assert {"flow_shift", "true_cfg_scale"} <= model.request_fields
    common = {"prompt": "a fox", "width": 32, "height": 32, "num_inference_steps": 3, "seed": 4}
    params = build_sampling_params(model, flow_shift=2.5, **common)
    assert signature_difference(params, build_sampling_params(model, **common)) == "sampling_params.flow_shift"
    ours = pipe.run([params]).outputs[0].images
    reference = FluxPipeline.from_pretrained(tiny_flux_path, local_files_only=True)
    reference.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        reference.scheduler.config, shift=2.5, use_dynamic_shifting=False
    )
    theirs = reference(
        prompt="a fox",
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=3.5,
        max_sequence_length=reference.tokenizer_2.model_max_length,
        generator=torch.Generator().manual_seed(4),
    ).images
    assert max_pixel_diff(ours, theirs) <= 1
    # Through the diffusers backend the request's scheduler is swapped in for the call, then restored.
    backend = load_pipeline(tiny_flux_path, backend="diffusers")
    original = backend.pipe.scheduler
    assert (
        max_pixel_diff(
            backend.run([build_sampling_params(backend.describe_model(), flow_shift=2.5, **common)]).outputs[0].images,
            theirs,
        )
        <= 1
    )
    assert backend.pipe.scheduler is original


def test_wan22_boundary_ratio_moves_the_expert_switch_as_diffusers(tiny_checkpoint):
    from diffusers import WanPipeline

    path = tiny_checkpoint("wan2.2")
    pipe = load_pipeline(path)
    model = pipe.describe_model()
    assert {"guidance_scale_2", "boundary_ratio"} <= model.request_fields
    common = {
        "prompt": "a cat surfing",
        "width": 32,
        "height": 32,
        "num_frames": 5,
        "num_inference_steps": 3,
        "seed": 3,
        "guidance_scale": 4.0,
        "guidance_scale_2": 2.0,
    }
    ours = pipe.run([build_sampling_params(model, boundary_ratio=0.5, **common)]).outputs[0].videos[0]
    reference = WanPipeline.from_pretrained(path, local_files_only=True)
    reference.register_to_config(boundary_ratio=0.5)
    frames = reference(
        prompt="a cat surfing",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=4.0,
        guidance_scale_2=2.0,
        output_type="np",
        generator=torch.Generator().manual_seed(3),
    ).frames[0]
    theirs = [(np.clip(f, 0, 1) * 255).round().astype("uint8") for f in frames]
    assert max_pixel_diff([ours], [theirs]) == 0
    backend = load_pipeline(path, backend="diffusers")
    assert {"guidance_scale_2", "boundary_ratio"} <= backend.describe_model().request_fields
    theirs_backend = backend.run([build_sampling_params(backend.describe_model(), boundary_ratio=0.5, **common)])
    assert max_pixel_diff(theirs_backend.outputs[0].videos, [theirs]) <= 1
    assert backend.pipe.config.boundary_ratio == 0.875  # the checkpoint's again after the call
    with pytest.raises(InvalidRequestError) as bad:
        build_sampling_params(model, boundary_ratio=1.5, **common)
    assert bad.value.param == "boundary_ratio"


def test_single_expert_wan_refuses_the_expert_fields(tiny_wan_path):
    model = load_pipeline(tiny_wan_path).describe_model()
    assert "flow_shift" in model.request_fields  # UniPC over flow sigmas
    for name in ("guidance_scale_2", "boundary_ratio"):
        with pytest.raises(InvalidRequestError) as bad:
            build_sampling_params(model, prompt="x", **{name: 0.5})
        assert bad.value.param == name and "two-expert" in bad.value.message


def test_layered_resolution_reaches_the_pipeline(tiny_checkpoint):
    pipe = load_pipeline(tiny_checkpoint("qwen-image-layered"))
    model = pipe.describe_model()
    assert {"layers", "resolution", "flow_shift"} <= model.request_fields  # its scheduler: FlowMatchEuler
    assert "boundary_ratio" not in model.request_fields
    params = build_sampling_params(model, prompt="a cat", n=2, resolution=1024, image_inputs=(_png(),))
    assert pipe._kwargs([params])["resolution"] == 1024 and pipe._kwargs([params])["layers"] == 2
    with pytest.raises(InvalidRequestError) as bad:
        build_sampling_params(model, prompt="a cat", resolution=512, image_inputs=(_png(),))
    assert bad.value.param == "resolution"
    with pytest.raises(InvalidRequestError) as bad:
        build_sampling_params(model, prompt="a cat", boundary_ratio=0.5, image_inputs=(_png(),))
    assert bad.value.param == "boundary_ratio"
