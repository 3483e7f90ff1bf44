"""Z-Image natively (ZImageNativePipeline) against diffusers.ZImagePipeline on the tiny checkpoint.

Tolerances: native vs diffusers is exact (0 uint8 steps): both load the same folder with the same model
classes, and the adapter feeds the transformer the same batch composition ([positives, negatives] in one
call), the same 512-token padded encoding and the same float order of the Z-Image CFG formula. A merged
batch row against its singleton run: at most 1/255 per channel (the transformer pads the rows of one call
to a common length, which may reorder float sums). Residency modes re-attach the same tensors: exact.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from diffuserve.config.plan import ResidencyMode
from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import (
    assert_rebuild_identical,
    assert_residency_modes_match,
    max_pixel_diff,
    row_generators,
    with_residency,
)
from tests.integration.helpers import decode_b64_png
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("z-image")


@pytest.fixture(scope="module")
def native(path: Path):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(path)


@pytest.fixture(scope="module")
def reference(path: Path):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_images(reference, params: SamplingParams) -> list:
    kwargs = {"negative_prompt": params.negative_prompt} if params.negative_prompt else {}
    return reference(params.prompt, height=params.height, width=params.width,
                     num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                     num_images_per_prompt=params.n, generator=row_generators(params.seed, params.n), **kwargs).images


def test_native_adapter_is_used(native) -> None:
    from diffuserve.families.z_image.adapter import ZImageNativePipeline

    assert isinstance(native, ZImageNativePipeline)
    assert native.defaults.width == native.defaults.height == 64  # the tiny VAE's sample_size


def test_tiny_build_is_byte_identical_and_small(path: Path, tmp_path: Path) -> None:
    assert_rebuild_identical("z-image", path, tmp_path)


@pytest.mark.parametrize(
    "params",
    [
        # Turbo-style: guidance 0 runs no negative branch.
        SamplingParams(prompt="a red cat", seed=7, guidance_scale=0.0, num_inference_steps=2),
        # CFG (any guidance > 0) with the default empty negative prompt, non-square, two rows.
        SamplingParams(prompt="a small dog on a big old house", seed=3, guidance_scale=3.0, n=2,
                       width=64, height=32, num_inference_steps=2),
        SamplingParams(prompt="sea at night", negative_prompt="blurry", seed=5, guidance_scale=4.0,
                       num_inference_steps=3),
    ],
    ids=["no-cfg", "cfg-n2-nonsquare", "cfg-negative"],
)
def test_native_matches_diffusers(native, reference, params: SamplingParams) -> None:
    ours = native.run([params]).outputs[0].images
    theirs = reference_images(reference, params)
    assert len(ours) == len(theirs) == params.n
    for a, b in zip(ours, theirs, strict=True):
        assert a.size == b.size == (params.width, params.height)
        assert max_pixel_diff([a], [b]) == 0


def test_merged_rows_equal_singletons(native) -> None:
    short = SamplingParams(prompt="a cat", seed=1, guidance_scale=3.0, num_inference_steps=2)
    long = SamplingParams(prompt="a very detailed painting of a big old house by the sea at night with stars",
                          negative_prompt="dark", seed=2, guidance_scale=3.0, n=2, num_inference_steps=2)
    assert len(native.tokenizer(long.prompt).input_ids) > 3 * len(native.tokenizer(short.prompt).input_ids)
    merged = native.run([short, long]).outputs
    singles = [native.run([short]).outputs[0], native.run([long]).outputs[0]]
    for m, s in zip(merged, singles, strict=True):
        assert len(m.images) == len(s.images)
        for a, b in zip(m.images, s.images, strict=True):
            assert max_pixel_diff([a], [b]) <= 1
    # The rows are genuinely different images (different prompts, seeds).
    assert max_pixel_diff(merged[0].images[:1], merged[1].images[:1]) > 8


def test_residency_modes_reproduce_resident(native) -> None:
    batch = [SamplingParams(prompt="a green tree", seed=9, guidance_scale=2.0, num_inference_steps=2)]
    diffs = assert_residency_modes_match(native, lambda: native.run(batch).outputs[0].images)
    assert set(diffs.values()) == {0}
    # Layer-wise, the declared layers really stream (not only the whole component).
    _, ledger = with_residency(native, {n: ResidencyMode.LAYERWISE_OFFLOAD for n in native.components},
                               lambda: native.run(batch))
    streamed = {(m.component, m.layer.rsplit(".", 1)[0]) for m in ledger.moves() if m.layer and m.direction == "h2d"}
    assert {("transformer", "noise_refiner"), ("transformer", "context_refiner"), ("transformer", "layers"),
            ("text_encoder", "layers")} <= streamed


def test_size_beyond_the_rope_tables_is_refused(native) -> None:
    # The tiny config's axes_lens allow 32 patches (512 px) per side.
    assert (native.max_width, native.max_height) == (512, 512)
    native.validate(SamplingParams(prompt="x", width=512, height=512))
    with pytest.raises(InvalidRequestError) as info:
        native.validate(SamplingParams(prompt="x", width=528, height=64))
    assert info.value.param == "size"


@pytest.fixture(scope="module")
def server(path: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("z-image-server")
    proc = ServerProcess(["--model-path", str(path), "--served-model-name", "tiny-z-image"], logs / "server.log")
    proc.start(timeout_s=240)
    yield proc
    proc.stop()


def test_openai_client_request_matches_diffusers(server, reference) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(model="tiny-z-image", prompt="a blue car", size="64x64",
                                    response_format="b64_json",
                                    extra_body={"num_inference_steps": 2, "guidance_scale": 2.5, "seed": 11})
    image = decode_b64_png(result.data[0].b64_json)
    expected = reference_images(reference, SamplingParams(prompt="a blue car", seed=11, guidance_scale=2.5,
                                                          num_inference_steps=2))[0]
    assert max_pixel_diff([image], [expected]) == 0
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model="tiny-z-image", prompt="too big", size="1024x1024")
    assert info.value.body["param"] == "size"
