"""Masks through the API and `generate`: OpenAI's `mask` on POST /v1/images/edits as the official `openai` SDK sends
it (fully transparent = repaint), a mask without alpha read by luminance, the 400s naming `mask` before queueing, and
`generate --mask-path`. Each answer equals the native pipeline's run of the same request (whose equality with the
diffusers inpaint pipelines is tests/integration/test_masks.py's), pixel for pixel (PNG is lossless; <= 1/255 allowed).
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from diffuserve import cli
from diffuserve.media.masks import inpaint_mask
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff
from tests.integration.helpers import decode_b64_png

W, H = 48, 32
BOX = (8, 8, 40, 24)
EXTRA = {"seed": 4, "num_inference_steps": 4, "strength": 0.7, "guidance_scale": 3.5}


def picture(seed: int = 0, size: tuple[int, int] = (W, H)) -> bytes:
    array = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def alpha_mask(size: tuple[int, int] = (W, H)) -> bytes:
    """OpenAI's mask: opaque everywhere but the box, which is fully transparent (repaint there)."""
    mask = Image.new("RGBA", size, (10, 200, 30, 255))
    mask.paste((0, 0, 0, 0), BOX)
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()


def gray_mask() -> bytes:
    """The same region as a mask without alpha: white = repaint (diffusers' reading, by luminance)."""
    mask = Image.new("RGB", (W, H), (0, 0, 0))
    mask.paste((255, 255, 255), BOX)
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _solo(native, mask: bytes | None, **fields) -> list[Image.Image]:
    params = SamplingParams(
        prompt="a red door",
        width=W,
        height=H,
        image_inputs=(picture(),),
        mask_input=None if mask is None else inpaint_mask(mask, image_size=(W, H), max_pixels=W * H),
        **{**EXTRA, **fields},
    )
    return native.run([params]).outputs[0].images


def test_openai_sdk_mask_edit_equals_the_pipeline(singleton_server, tiny_flux_path, family_pipeline):
    client = _client(singleton_server)
    result = client.images.edit(
        image=("in.png", picture(), "image/png"),
        mask=("mask.png", alpha_mask(), "image/png"),
        prompt="a red door",
        n=2,
        extra_body=EXTRA,
    )
    images = [decode_b64_png(d.b64_json) for d in result.data]
    assert [im.size for im in images] == [(W, H)] * 2
    assert max_pixel_diff(images, _solo(family_pipeline(tiny_flux_path), alpha_mask(), n=2)) <= 1
    # The same region as a black-and-white mask without alpha: read by luminance, the same edit.
    gray = client.images.edit(
        image=("in.png", picture(), "image/png"),
        mask=("mask.png", gray_mask(), "image/png"),
        prompt="a red door",
        n=2,
        extra_body=EXTRA,
    )
    assert max_pixel_diff([decode_b64_png(d.b64_json) for d in gray.data], images) == 0


def test_padding_mask_crop_reaches_the_pipeline(singleton_server, tiny_flux_path, family_pipeline):
    result = _client(singleton_server).images.edit(
        image=("in.png", picture(), "image/png"),
        mask=("mask.png", alpha_mask(), "image/png"),
        prompt="a red door",
        extra_body={**EXTRA, "padding_mask_crop": 2},
    )
    expected = _solo(family_pipeline(tiny_flux_path), alpha_mask(), padding_mask_crop=2)
    assert max_pixel_diff([decode_b64_png(result.data[0].b64_json)], expected) <= 1


@pytest.mark.parametrize(
    ("mask", "says"),
    [
        (alpha_mask((W + 16, H)), "must be exactly the size"),
        (b"not an image", "not a"),
    ],
    ids=["other-size", "not-an-image"],
)
def test_bad_masks_are_400s_naming_mask(singleton_server, mask, says):
    with pytest.raises(openai.BadRequestError) as err:
        _client(singleton_server).images.edit(
            image=("in.png", picture(), "image/png"), mask=("mask.png", mask, "image/png"), prompt="x"
        )
    assert err.value.body["param"] == "mask" and says in err.value.body["message"], err.value.body


def test_a_mask_string_must_be_base64_image_bytes(singleton_server):
    response = httpx.post(
        f"{singleton_server.base_url}/v1/images/edits",
        files={"image": ("in.png", picture())},
        data={"prompt": "x", "mask": "https://example.com/mask.png"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "mask", response.text


def test_generate_mask_path_equals_the_pipeline(tiny_flux_path, family_pipeline, tmp_path, capsys):
    image, mask = tmp_path / "in.png", tmp_path / "mask.png"
    image.write_bytes(picture())
    mask.write_bytes(alpha_mask())
    flags = ["--image-path", str(image), "--mask-path", str(mask), "--prompt", "a red door", "--seed", "4"]
    flags += ["--num-inference-steps", "4", "--strength", "0.7", "--guidance-scale", "3.5"]
    out = tmp_path / "out"
    code = cli.main(["generate", "--model-path", str(tiny_flux_path), "--output-path", str(out), *flags])
    written = capsys.readouterr().out.split()
    assert code == 0 and len(written) == 1, written
    assert max_pixel_diff([Image.open(written[0])], _solo(family_pipeline(tiny_flux_path), alpha_mask())) <= 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--mask-path", "MASK_OTHER"], "must be exactly the size"),
        (["--padding-mask-crop", "4"], "needs --mask-path"),
    ],
)
def test_generate_refuses_bad_masks_before_loading(tiny_flux_path, tmp_path, capsys, monkeypatch, flags, says):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("diffuserve.launch.root.build_generate_engine", refuse)
    image, other = tmp_path / "in.png", tmp_path / "other.png"
    image.write_bytes(picture())
    other.write_bytes(alpha_mask((W, H + 16)))
    flags = [str(other) if f == "MASK_OTHER" else f for f in flags]
    code = cli.main(
        ["generate", "--model-path", str(tiny_flux_path), "--image-path", str(image), "--prompt", "x", *flags]
    )
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
