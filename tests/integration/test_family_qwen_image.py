"""Qwen-Image (QwenImagePipeline) and Qwen-Image 2.1 (QwenImage21Pipeline), native, on their tiny checkpoints.

References: the diffusers pipeline built around the very modules our loader loaded (so weights are the same
tensors, see STACK.md on safetensors alignment), called with the same prompt, negative prompt, size, steps,
true_cfg_scale and one CPU generator per row (seed + j). Tolerances: native vs diffusers exact (0/255);
a merged row vs its singleton run at most 1/255 per pixel (batched matmuls round differently); residency
modes exact (the same tensors re-attached on CPU).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import assert_residency_modes_match, layered_components
from tests.integration.helpers import decode_b64_png
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)

TINY = {"qwen_image": "qwen-image", "qwen_image_21": "qwen-image-2.1"}
"""family -> make-tiny name."""
CFG = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}
SHORT = "a cat"
LONG = "a big old red house on a small green mountain under the night sky"


@pytest.fixture(scope="module")
def pipes(tiny_checkpoint) -> dict[str, object]:
    from diffuserve.models.loader import load_pipeline

    return {family: load_pipeline(tiny_checkpoint(name)) for family, name in TINY.items()}


def _reference(pipe):
    """The diffusers pipeline class of `pipe`'s family around the same loaded modules."""
    from diffusers import QwenImage21Pipeline, QwenImagePipeline

    if pipe.family == "qwen_image":
        return QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                 tokenizer=pipe.tokenizer, transformer=pipe.transformer)
    return QwenImage21Pipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                               processor=pipe.processor, transformer=pipe.transformer)


def _params(**kw) -> SamplingParams:
    base = {"width": 64, "height": 64, "num_inference_steps": 2, "seed": 7}
    return SamplingParams(**{**base, **kw})


def _arrays(images) -> list[np.ndarray]:
    return [np.asarray(im, dtype=np.int16) for im in images]


def _run(pipe, batch: list[SamplingParams]) -> list[list[np.ndarray]]:
    return [_arrays(out.images) for out in pipe.run(batch).outputs]


def _token_count(pipe, text: str) -> int:
    return int(pipe.encode_text("text_encoder", [text], [])["mask"].sum())


# -- the tiny checkpoints -------------------------------------------------------------------------------


def _digest(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("family", list(TINY))
def test_tiny_checkpoint_is_reproducible_small_and_loads_in_diffusers(family, tiny_checkpoint, tmp_path) -> None:
    from diffusers import DiffusionPipeline

    from diffuserve.models.processor_substitutes import install_processor_substitutes
    from diffuserve.models.tiny import build_tiny_checkpoint

    first = tiny_checkpoint(TINY[family])
    again = build_tiny_checkpoint(TINY[family], tmp_path / "again")
    assert _digest(first) == _digest(again)
    assert sum(f.stat().st_size for f in first.rglob("*") if f.is_file()) < 10 * 2**20
    install_processor_substitutes()  # Qwen3VLProcessor without torchvision (a no-op where it exists)
    pipe = DiffusionPipeline.from_pretrained(first, local_files_only=True)
    assert type(pipe).__name__ == {"qwen_image": "QwenImagePipeline", "qwen_image_21": "QwenImage21Pipeline"}[family]
    if family == "qwen_image":
        # The tiny vocabulary tokenizes the template's system prefix into exactly the tokens diffusers drops.
        prefix = pipe.prompt_template_encode.split("{}")[0]
        assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx


# -- native == diffusers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(TINY))
def test_native_matches_diffusers_pipeline(family, pipes) -> None:
    pipe = pipes[family]
    got = _run(pipe, [_params(prompt=LONG, n=2, **CFG)])[0]
    want = _reference(pipe)(
        prompt=LONG, height=64, width=64, num_inference_steps=2, num_images_per_prompt=2,
        generator=[torch.Generator().manual_seed(7 + j) for j in range(2)], **CFG,
    ).images
    assert len(got) == 2 and (got[0] != got[1]).any()
    for g, w in zip(got, _arrays(want), strict=True):
        assert np.abs(g - w).max() == 0


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
def test_merged_rows_equal_their_singletons(family, cfg, pipes) -> None:
    pipe = pipes[family]
    assert _token_count(pipe, SHORT) < _token_count(pipe, LONG)
    guidance = {"true_cfg_scale": 4.0} if cfg else {"true_cfg_scale": 1.0}
    a = _params(prompt=SHORT, seed=1, negative_prompt="blurry" if cfg else None, **guidance)
    b = _params(prompt=LONG, seed=2, n=2, negative_prompt="low quality, ugly, dark" if cfg else None, **guidance)
    merged = _run(pipe, [a, b])
    singles = [_run(pipe, [a])[0], _run(pipe, [b])[0]]
    for got, want in zip(merged, singles, strict=True):
        for g, w in zip(got, want, strict=True):
            assert np.abs(g - w).max() <= 1


# -- residency ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(TINY))
def test_residency_modes_reproduce_the_resident_output(family, pipes) -> None:
    from diffuserve.runtime.layerwise import default_layer_specs

    pipe = pipes[family]
    # Layer-wise offload streams the DiT's blocks and the text encoder's decoder layers (and the VAE's).
    assert default_layer_specs("transformer", pipe.transformer) == ["transformer_blocks"]
    assert default_layer_specs("text_encoder", pipe.text_encoder) == ["model.language_model.layers"]
    assert set(layered_components(pipe)) == {"transformer", "text_encoder", "vae"}
    batch = [_params(prompt=SHORT, seed=3, **CFG), _params(prompt=LONG, seed=4, **CFG)]
    diffs = assert_residency_modes_match(pipe, lambda: [im for out in pipe.run(batch).outputs for im in out.images])
    assert set(diffs.values()) == {0}


# -- limits -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(TINY))
def test_sizes_beyond_the_rope_table_or_off_the_grid_are_refused(family, pipes) -> None:
    pipe = pipes[family]
    assert pipe.max_width == pipe.max_height
    pipe.validate(_params(prompt="x", width=pipe.max_width, height=pipe.size_multiple))
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(_params(prompt="x", width=pipe.max_width + pipe.size_multiple, height=pipe.size_multiple))
    assert info.value.param == "size"
    with pytest.raises(InvalidRequestError):
        pipe.validate(_params(prompt="x", width=pipe.size_multiple + 8, height=64))


def test_qwen_image_21_refuses_a_prompt_longer_than_its_text_positions(pipes) -> None:
    pipe = pipes["qwen_image_21"]
    pipe.validate(_params(prompt="\u00e9" * 3000))  # 6000 byte tokens in the tiny vocabulary: fits
    for field in ("prompt", "negative_prompt"):
        with pytest.raises(InvalidRequestError) as info:
            pipe.validate(_params(**{"prompt": "x", field: "\u00e9" * 5000}))  # 10000 tokens
        assert info.value.param == field


def test_rope_limits_follow_the_tables(pipes) -> None:
    """The limits come from the transformers' RoPE tables: Qwen-Image's text starts max(h, w) // 2 positions
    in, so the last image side leaves exactly the 512 text positions; 2.1 centres rows on its negative table."""
    from diffuserve.families.qwen_image.spec import QWEN_IMAGE_21_ROPE_POSITIONS, QWEN_IMAGE_ROPE_POSITIONS

    qi, q21 = pipes["qwen_image"].transformer.pos_embed, pipes["qwen_image_21"].transformer.pos_embed
    # The spec's table sizes (torch-free, for both backends) are diffusers' own.
    assert qi.pos_freqs.shape[0] == qi.neg_freqs.shape[0] == QWEN_IMAGE_ROPE_POSITIONS
    assert all(f.shape[0] == sum(QWEN_IMAGE_21_ROPE_POSITIONS) for f in q21.freqs)
    tokens = pipes["qwen_image"].max_width // 16
    _, txt = qi(video_fhw=[(1, tokens, 2)], max_txt_seq_len=512, device=torch.device("cpu"))
    assert txt.shape[0] == 512
    _, txt = qi(video_fhw=[(1, tokens + 2, 2)], max_txt_seq_len=512, device=torch.device("cpu"))
    assert txt.shape[0] < 512  # one row more and the text would index past the table
    side = pipes["qwen_image_21"].max_width // 16
    neg = side - side // 2
    for axis, dim in enumerate(q21.axes_dim):
        expected = q21.rope_params(torch.tensor([-neg]), dim, q21.theta)[0]
        assert torch.equal(q21.freqs[axis][-neg], expected)  # the most negative row is still the negative table's


# -- one request through a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    started: dict[str, ServerProcess] = {}
    try:
        for family, name in TINY.items():
            logs = tmp_path_factory.mktemp(family)
            started[family] = ServerProcess(
                ["--model-path", str(tiny_checkpoint(name)), "--served-model-name", name], logs / "server.log"
            ).start(timeout_s=240)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.parametrize("family", list(TINY))
def test_openai_client_request_matches_the_in_process_run(family, servers, pipes) -> None:
    client = openai.OpenAI(base_url=f"{servers[family].base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(
        model=TINY[family], prompt=LONG, size="64x64", n=1, response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 11, **CFG},
    )
    image = decode_b64_png(result.data[0].b64_json)
    assert image.size == (64, 64)
    # Lossless PNG of the same pixels (Qwen-Image 2.1's VAE decodes RGBA, and the PNG keeps the alpha).
    want = _run(pipes[family], [_params(prompt=LONG, seed=11, **CFG)])[0][0]
    assert image.mode == {3: "RGB", 4: "RGBA"}[want.shape[-1]]
    assert (np.asarray(image, dtype=np.int16) == want).all()


# -- Qwen-Image 2.1 Turbo: the checkpoint's own sigma grid --------------------------------------------------


def test_turbo_grid_from_model_index_matches_diffusers(tiny_checkpoint, tmp_path) -> None:
    """A 2.1 checkpoint with `sample_sigmas` in model_index.json (Turbo) samples on that grid, which fixes the
    step count: the default follows it, another count is a 400, and the output equals diffusers'."""
    import json
    import shutil

    from diffuserve.models.loader import load_pipeline

    folder = shutil.copytree(tiny_checkpoint("qwen-image-2.1"), tmp_path / "turbo")
    index = json.loads((folder / "model_index.json").read_text())
    index["sample_sigmas"] = [1.0, 0.7, 0.4]
    index.pop("_diffuserve_defaults")  # a tiny model's suggested 4 steps would otherwise win
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(folder)
    assert pipe.defaults.num_inference_steps == 3
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(_params(prompt="x", num_inference_steps=4))
    assert info.value.param == "num_inference_steps"
    got = _run(pipe, [_params(prompt=LONG, num_inference_steps=3)])[0]
    reference = _reference(pipe)
    reference.register_to_config(sample_sigmas=index["sample_sigmas"])
    want = reference(prompt=LONG, height=64, width=64, generator=torch.Generator().manual_seed(7)).images
    assert np.abs(got[0] - _arrays(want)[0]).max() == 0
