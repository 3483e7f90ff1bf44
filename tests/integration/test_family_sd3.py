"""SD3 / SD3.5 natively: against diffusers.StableDiffusion3Pipeline, batching, residency, HTTP.

Tolerances: against diffusers, 0 (identical pixels) when both run the very same weight tensors, and one
uint8 step (1/255) when each loads the folder itself (safetensors-loaded weights may sit at unaligned
addresses, so CPU kernels differ by ~1e-6). A merged row against its singleton: one step (a matmul over
more rows may round differently). Residency modes against the resident run: 0 (the same tensors).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255


@pytest.fixture(scope="module")
def native(tiny_sd3_path: Path):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(tiny_sd3_path)  # backend auto: native for SD3


@pytest.fixture(scope="module")
def reference(tiny_sd3_path: Path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def twin(reference):
    """The native adapter over the diffusers pipeline's own modules (the very same weight tensors)."""
    from diffuserve.families.sd3.adapter import SD3NativePipeline

    return SD3NativePipeline.from_components(dict(reference.components), device="cpu", dtype=torch.float32)


def _px(image) -> np.ndarray:
    return np.asarray(image).astype(np.int16)


def _max_diff(a, b) -> int:
    return int(np.abs(_px(a) - _px(b)).max())


def _reference_images(reference, params: SamplingParams) -> list:
    return reference(
        params.prompt,
        negative_prompt=params.negative_prompt,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        num_images_per_prompt=params.n,
        generator=[torch.Generator().manual_seed(params.seed + j) for j in range(params.n)],
        # The tiny tokenizer_3 declares 64 tokens; diffuserve caps diffusers' 256 by it.
        max_sequence_length=reference.tokenizer_3.model_max_length if reference.tokenizer_3 else 256,
    ).images


def test_tiny_builder_is_byte_identical_small_and_loads(tiny_sd3_path: Path, tmp_path: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    from diffuserve.families.sd3 import tiny as tiny_sd3

    def digest(folder: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(folder)).encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    tiny_sd3.build(tmp_path / "again")
    assert digest(tmp_path / "again") == digest(tiny_sd3_path)
    assert sum(f.stat().st_size for f in tiny_sd3_path.rglob("*") if f.is_file()) < 10 * 2**20
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "again", local_files_only=True)
    assert pipe.transformer.config.pos_embed_max_size == tiny_sd3.POS_EMBED_MAX_SIZE


def test_defaults_and_limits_come_from_the_checkpoint(native, reference) -> None:
    import inspect

    from diffuserve.families.sd3.adapter import SD3NativePipeline

    assert isinstance(native, SD3NativePipeline) and native.family == "sd3"
    # diffusers' call defaults: transformer sample size x VAE factor (64 px here), 28 steps, guidance 7.0.
    call = inspect.signature(type(reference).__call__).parameters
    d = native.defaults
    assert (d.width, d.height) == (reference.default_sample_size * reference.vae_scale_factor,) * 2 == (64, 64)
    assert (d.num_inference_steps, d.guidance_scale) == (call["num_inference_steps"].default,
                                                        call["guidance_scale"].default) == (28, 7.0)
    assert native.size_multiple == 16 and native.max_width == native.max_height == 32 * 2 * 8
    native.validate(SamplingParams(prompt="x", width=512, height=64))
    with pytest.raises(InvalidRequestError, match="positional table") as err:
        native.validate(SamplingParams(prompt="x", width=528, height=64))
    assert err.value.param == "size"


@pytest.mark.parametrize(
    "params",
    [
        # diffusers' defaults: CFG at 7.0 against the empty negative prompt
        SamplingParams(prompt="a photo of a cat", seed=5, n=2, num_inference_steps=3, guidance_scale=7.0),
        SamplingParams(prompt="a red fox", negative_prompt="blurry", seed=1, num_inference_steps=3,
                       guidance_scale=4.5, width=48, height=32),
        # guidance_scale <= 1: no CFG branch at all
        SamplingParams(prompt="a tree", seed=2, num_inference_steps=3, guidance_scale=1.0),
    ],
    ids=["cfg-default-negative", "cfg-negative-48x32", "no-cfg"],
)
def test_native_matches_diffusers(native, twin, reference, params: SamplingParams) -> None:
    theirs = _reference_images(reference, params)
    same_weights = twin.run([params]).outputs[0].images
    loaded = native.run([params]).outputs[0].images
    assert len(same_weights) == len(loaded) == len(theirs) == params.n
    for a, b, ref in zip(same_weights, loaded, theirs, strict=True):
        assert a.size == b.size == (params.width, params.height)
        assert _max_diff(a, ref) == 0
        assert _max_diff(b, ref) <= PIXEL_TOL


def test_checkpoint_saved_without_t5_matches_diffusers(reference, tmp_path: Path) -> None:
    """diffusers lets SD3 drop T5 (its tokens become zeros); such a folder loads and runs natively."""
    from diffusers import StableDiffusion3Pipeline

    from diffuserve.models.loader import load_pipeline

    without = StableDiffusion3Pipeline(**{**reference.components, "text_encoder_3": None, "tokenizer_3": None})
    without.set_progress_bar_config(disable=True)
    without.save_pretrained(tmp_path / "no-t5")
    loaded = load_pipeline(tmp_path / "no-t5")
    assert loaded.text_encoders == ("text_encoder", "text_encoder_2") and "text_encoder_3" not in loaded.components
    params = SamplingParams(prompt="a red fox", seed=2, num_inference_steps=2, guidance_scale=5.0)
    theirs = _reference_images(without, params)  # max_sequence_length: diffusers' 256, nothing to cap it
    assert _max_diff(loaded.run([params]).outputs[0].images[0], theirs[0]) <= PIXEL_TOL


def test_cached_empty_negative_is_a_fresh_encoding(twin) -> None:
    """CFG without a negative prompt reuses one encoding of "": it must be what a fresh call gives."""
    with torch.inference_mode():
        for key in twin.text_encoders:
            cached, fresh = twin._encode_empty(key), twin._encode_group(key, [""])
            assert cached.keys() == fresh.keys()
            assert all(torch.equal(cached[k], fresh[k]) for k in fresh)


def test_merged_rows_equal_their_singletons(native) -> None:
    # Prompts of different token lengths (and one repeated), negative prompts on some rows.
    batch = [
        SamplingParams(prompt="a cat", seed=1, n=2, num_inference_steps=2, guidance_scale=5.0),
        SamplingParams(prompt="a detailed painting of an old house by the sea at night", negative_prompt="dark",
                       seed=9, num_inference_steps=2, guidance_scale=5.0),
        SamplingParams(prompt="a cat", seed=4, num_inference_steps=2, guidance_scale=5.0),
    ]
    merged = native.run(batch).outputs
    assert [len(o.images) for o in merged] == [2, 1, 1]
    for params, output in zip(batch, merged, strict=True):
        alone = native.run([params]).outputs[0].images
        for a, b in zip(output.images, alone, strict=True):
            assert _max_diff(a, b) <= PIXEL_TOL


def test_residency_modes_reproduce_the_resident_output(native) -> None:
    from tests.integration.family_checks import assert_residency_modes_match, layered_components

    # The DiT and all three text encoders have repeated layers: layer-wise streams each of them.
    assert {"transformer", "text_encoder", "text_encoder_2", "text_encoder_3"} <= set(layered_components(native))
    params = [SamplingParams(prompt="a red cat", negative_prompt="blurry", seed=7, n=2,
                             num_inference_steps=2, guidance_scale=4.0)]
    diffs = assert_residency_modes_match(native, lambda: native.run(params).outputs[0].images)
    assert set(diffs.values()) == {0}


# -- over a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd3_server(tiny_sd3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("sd3-server")
    server = ServerProcess(["--model-path", str(tiny_sd3_path), "--served-model-name", "tiny-sd3",
                            "--warmup-steps", "1"], logs / "server.log")
    server.start(timeout_s=240)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(sd3_server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=f"{sd3_server.base_url}/v1", api_key="unused", max_retries=0)


def test_generation_over_the_server_equals_the_native_run(client, native) -> None:
    import base64
    import io

    from PIL import Image

    result = client.images.generate(model="tiny-sd3", prompt="a blue bird", size="64x64", n=2,
                                    extra_body={"num_inference_steps": 2, "seed": 11, "guidance_scale": 3.0})
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
    expected = native.run([SamplingParams(prompt="a blue bird", seed=11, n=2, num_inference_steps=2,
                                          guidance_scale=3.0)]).outputs[0].images
    assert [im.size for im in images] == [(64, 64)] * 2
    for a, b in zip(images, expected, strict=True):
        assert _max_diff(a.convert("RGB"), b) <= PIXEL_TOL


def test_size_beyond_the_positional_table_is_a_400_naming_size(client) -> None:
    import openai

    with warnings.catch_warnings(), pytest.raises(openai.BadRequestError) as err:
        warnings.simplefilter("ignore")
        client.images.generate(model="tiny-sd3", prompt="too big", size="528x528",  # type: ignore[arg-type]
                               extra_body={"num_inference_steps": 1})
    body = err.value.body
    assert isinstance(body, dict)
    error = body.get("error", body)
    assert error["param"] == "size" and "512" in error["message"]
