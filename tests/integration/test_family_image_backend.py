"""Image families through the diffusers backend: ERNIE-Image and Qwen-Image-Layered on their tiny checkpoints.

Each family is served by `DiffusersBackendPipeline` (no native adapter) and compared with its diffusers pipeline
class called directly on the same folder, with the same arguments and one generator per output row
(`seed + j`). Tolerances: backend vs direct call is exact (0/255: it is the same call); a merged ERNIE row
against its solo run is within 1/255 (ERNIE encodes every prompt alone and pads; only the batch size of the
kernels differs).
"""

from __future__ import annotations

import io
from pathlib import Path

import openai
import pytest
from PIL import Image

from diffuserve.errors import InvalidRequestError
from diffuserve.models.loader import load_pipeline
from diffuserve.models.processor_substitutes import install_processor_substitutes
from diffuserve.pipelines.diffusers_backend import DiffusersBackendPipeline
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import assert_rebuild_identical, max_pixel_diff, row_generators
from tests.integration.helpers import decode_b64_png
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)


def _direct(cls_name: str, path: Path):
    import diffusers

    install_processor_substitutes()
    pipe = getattr(diffusers, cls_name).from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- ERNIE-Image ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ernie_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("ernie-image")


@pytest.fixture(scope="module")
def ernie(ernie_path: Path) -> DiffusersBackendPipeline:
    pipeline = load_pipeline(ernie_path)
    assert isinstance(pipeline, DiffusersBackendPipeline) and pipeline.family == "ernie_image"
    return pipeline


@pytest.fixture(scope="module")
def ernie_reference(ernie_path: Path):
    return _direct("ErnieImagePipeline", ernie_path)


def _ernie_reference_images(reference, params: SamplingParams) -> list[Image.Image]:
    return reference([params.prompt] * params.n, negative_prompt=[params.negative_prompt or ""] * params.n,
                     height=params.height, width=params.width, num_inference_steps=params.num_inference_steps,
                     guidance_scale=params.guidance_scale, generator=row_generators(params.seed, params.n)).images


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(prompt="a red cat", seed=7, guidance_scale=1.0, n=2, num_inference_steps=2),
        SamplingParams(prompt="a dog in the sea", negative_prompt="blurry", seed=3, guidance_scale=4.0,
                       width=96, height=64, num_inference_steps=2),
    ],
    ids=["no-cfg-n2", "cfg-negative-wide"],
)
def test_ernie_backend_matches_diffusers(ernie, ernie_reference, params: SamplingParams) -> None:
    ours = ernie.run([params]).outputs[0].images
    theirs = _ernie_reference_images(ernie_reference, params)
    assert [im.size for im in ours] == [(params.width, params.height)] * params.n
    assert max_pixel_diff(ours, theirs) == 0


def test_ernie_merged_rows_equal_singletons(ernie) -> None:
    short = SamplingParams(prompt="a cat", seed=1, guidance_scale=4.0, num_inference_steps=2)
    long = SamplingParams(prompt="a very detailed painting of a big old house by the sea at night", seed=2,
                          guidance_scale=4.0, n=2, num_inference_steps=2)
    merged = ernie.run([short, long]).outputs
    singles = [ernie.run([short]).outputs[0], ernie.run([long]).outputs[0]]
    for m, s in zip(merged, singles, strict=True):
        assert max_pixel_diff(m.images, s.images) <= 1
    assert max_pixel_diff(merged[0].images[:1], merged[1].images[:1]) > 8


def test_ernie_tiny_build_is_byte_identical_and_small(ernie_path: Path, tmp_path: Path) -> None:
    assert_rebuild_identical("ernie-image", ernie_path, tmp_path)


@pytest.fixture(scope="module")
def ernie_server(ernie_path: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("ernie-server")
    proc = ServerProcess(["--model-path", str(ernie_path), "--served-model-name", "tiny-ernie"], logs / "server.log")
    proc.start(timeout_s=240)
    yield proc
    proc.stop()


def test_ernie_openai_client_request_matches_diffusers(ernie_server, ernie_reference) -> None:
    client = openai.OpenAI(base_url=f"{ernie_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(model="tiny-ernie", prompt="a blue car", size="64x64", n=2,
                                    response_format="b64_json",
                                    extra_body={"num_inference_steps": 2, "guidance_scale": 4.0, "seed": 11})
    images = [decode_b64_png(item.b64_json) for item in result.data]
    expected = _ernie_reference_images(ernie_reference, SamplingParams(prompt="a blue car", seed=11, n=2,
                                                                       guidance_scale=4.0, num_inference_steps=2))
    assert max_pixel_diff(images, expected) <= 1  # PNG round trip of the same uint8 image: exact in practice
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model="tiny-ernie", prompt="not a multiple of 16", size="72x64")
    assert info.value.body["param"] == "size"


# -- Qwen-Image-Layered --------------------------------------------------------------------------------


def _rgba_png(width: int, height: int) -> bytes:
    image = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    image.paste((220, 40, 30, 255), (8, 8, width // 2, height // 2))
    image.paste((30, 60, 200, 160), (width // 3, height // 3, width - 4, height - 4))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def layered_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen-image-layered")


@pytest.fixture(scope="module")
def layered(layered_path: Path) -> DiffusersBackendPipeline:
    pipeline = load_pipeline(layered_path)
    assert isinstance(pipeline, DiffusersBackendPipeline) and pipeline.family == "qwen_image_layered"
    assert pipeline.layered and not pipeline.supports_batching
    return pipeline


def test_layered_returns_n_layers_matching_diffusers(layered, layered_path: Path) -> None:
    source = _rgba_png(64, 48)
    params = SamplingParams(prompt="a red cat", seed=5, n=2, guidance_scale=1.0, num_inference_steps=2,
                            image_inputs=(source,))
    ours = layered.run([params]).outputs[0].images
    reference = _direct("QwenImageLayeredPipeline", layered_path)
    theirs = reference(Image.open(io.BytesIO(source)).convert("RGBA"), "a red cat", layers=2,
                       num_inference_steps=2, true_cfg_scale=1.0,
                       generator=row_generators(5, 1)).images[0]
    assert len(ours) == len(theirs) == 2
    # The pipeline's own size rule: a 640x640 area at the input's aspect ratio, rounded to its multiple.
    assert {im.size for im in ours} == {theirs[0].size} and ours[0].mode == "RGBA"
    assert max_pixel_diff(ours, theirs) == 0


def test_layered_needs_one_input_image(layered) -> None:
    with pytest.raises(InvalidRequestError) as info:
        layered.validate(SamplingParams(prompt="no image", n=2))
    assert info.value.param == "image"


def test_layered_tiny_build_is_byte_identical_and_small(layered_path: Path, tmp_path: Path) -> None:
    assert_rebuild_identical("qwen-image-layered", layered_path, tmp_path)


# -- GLM-Image -----------------------------------------------------------------------------------------
# Tolerances: a solo request equals `GlmImagePipeline.__call__` exactly (same AR draws: its seed; same DiT call).
# A merged batch shares one AR call: its rows' prior tokens equal their solo runs' exactly (each row draws from its
# own seed; a different batch only changes the left padding), and the images are then exact too (per-request DiT).


@pytest.fixture(scope="module")
def glm_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("glm-image")


@pytest.fixture(scope="module")
def glm(glm_path: Path) -> DiffusersBackendPipeline:
    pipeline = load_pipeline(glm_path)
    assert isinstance(pipeline, DiffusersBackendPipeline) and pipeline.family == "glm_image"
    assert pipeline.ar_prior and pipeline.supports_batching and pipeline.size_multiple == 32
    return pipeline


def test_glm_solo_matches_diffusers_and_merged_rows_equal_singletons(glm, glm_path: Path) -> None:
    first = SamplingParams(prompt="a sign that says 'OPEN'", seed=4, n=2, guidance_scale=1.5, num_inference_steps=2)
    second = SamplingParams(prompt="a cat", seed=9, guidance_scale=1.5, num_inference_steps=2)
    solo = glm.run([first]).outputs[0].images
    reference = _direct("GlmImagePipeline", glm_path)
    expected = reference(first.prompt, height=64, width=64, num_inference_steps=2, guidance_scale=1.5,
                         num_images_per_prompt=2, generator=row_generators(4, 2)).images
    assert len(solo) == 2 and max_pixel_diff(solo, expected) == 0

    # One AR call for both requests (its own stage time), then DiT and VAE per request: every row equals its solo run.
    result = glm.run([first, second])
    assert set(result.stage_seconds) == {"ar", "dit_vae", "total"}
    merged = result.outputs
    assert max_pixel_diff(merged[0].images, solo) == 0
    assert max_pixel_diff(merged[1].images, glm.run([second]).outputs[0].images) == 0
    assert max_pixel_diff(merged[0].images[:1], merged[1].images) > 8


def test_glm_refuses_sizes_off_its_32_px_grid(glm) -> None:
    with pytest.raises(InvalidRequestError) as info:
        glm.validate(SamplingParams(prompt="x", width=48, height=64))
    assert info.value.param == "size"


def test_glm_tiny_build_is_byte_identical_and_small(glm_path: Path, tmp_path: Path) -> None:
    assert_rebuild_identical("glm-image", glm_path, tmp_path)
