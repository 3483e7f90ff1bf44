"""Qwen-Image-Edit and Qwen-Image-Edit 2509/2511 (EditPlus): the native adapters against diffusers, residency
modes against the resident run, and /v1/images/edits through a real server with the official openai client.

Tolerance everywhere: exact (0/255 per pixel). Native and diffusers load the same folder and run the same
operations in the same order; residency modes move the same weights without changing a kernel.

Cost: the pipelines resize every input to ~1024x1024 for the VAE (fixed in diffusers), ~1-2 s per input image
and call with the tiny VAE, so each test reuses one reference run and the servers' answers are compared with it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from diffuserve.models.loader import load_pipeline
from diffuserve.models.processor_substitutes import install_processor_substitutes
from diffuserve.sampling import SamplingParams
from tests.integration.helpers import decode_b64_png, pixels, wait_for_log
from tests.serverproc import ServerProcess


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    """A two-tone picture: distinct inputs give visibly different edits with the tiny model."""
    array = np.zeros((height, width, 3), dtype=np.uint8)
    array[...] = colour
    array[: height // 2, :, 1] = 255 - colour[1]
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


RED = _png(64, 64, (200, 30, 30))
BLUE_WIDE = _png(80, 48, (30, 30, 200))
PROMPT = "make the sky green"
# The family defaults (true CFG 4 with a " " negative prompt) spelled out, so the diffusers call is explicit.
EDIT = SamplingParams(prompt=PROMPT, negative_prompt=" ", true_cfg_scale=4.0, width=64, height=64,
                      num_inference_steps=2, seed=11, n=2, image_inputs=(RED,))
PLUS = SamplingParams(prompt=PROMPT, negative_prompt=" ", true_cfg_scale=4.0, width=64, height=64,
                      num_inference_steps=2, seed=5, n=1, image_inputs=(RED, BLUE_WIDE))


def _diffusers(path: Path, class_name: str, params: SamplingParams) -> list[Image.Image]:
    import diffusers

    install_processor_substitutes()
    pipe = getattr(diffusers, class_name).from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in params.image_inputs]
    return pipe(image=images[0] if class_name == "QwenImageEditPipeline" else images, prompt=params.prompt,
                negative_prompt=params.negative_prompt, true_cfg_scale=params.true_cfg_scale, width=params.width,
                height=params.height, num_inference_steps=params.num_inference_steps,
                num_images_per_prompt=params.n,
                generator=[torch.Generator().manual_seed(params.seed + j) for j in range(params.n)]).images


def _assert_same(ours: list[Image.Image], theirs: list[Image.Image]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.size == b.size
        assert int(np.abs(pixels(a) - pixels(b)).max()) == 0


@pytest.fixture(scope="module")
def edit_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen-image-edit")


@pytest.fixture(scope="module")
def plus_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen-image-edit-plus")


@pytest.fixture(scope="module")
def edit_native(edit_path: Path):
    return load_pipeline(edit_path)


@pytest.fixture(scope="module")
def edit_reference(edit_native) -> list[Image.Image]:
    """The resident native run of EDIT (n=2): what diffusers, the residency modes and the server must give."""
    return edit_native.run([EDIT]).outputs[0].images


@pytest.fixture(scope="module")
def plus_reference(plus_path: Path) -> list[Image.Image]:
    return load_pipeline(plus_path).run([PLUS]).outputs[0].images


def test_edit_matches_diffusers_with_n_outputs(edit_path: Path, edit_native, edit_reference) -> None:
    assert type(edit_native).__name__ == "QwenImageEditNativePipeline"
    assert len(edit_reference) == 2 and all(im.size == (64, 64) for im in edit_reference)
    # Row j is its own draw (seed + j), not a copy of row 0.
    assert int(np.abs(pixels(edit_reference[0]) - pixels(edit_reference[1])).max()) > 0
    _assert_same(edit_reference, _diffusers(edit_path, "QwenImageEditPipeline", EDIT))


def test_edit_plus_with_two_images_matches_diffusers(plus_path: Path, plus_reference) -> None:
    _assert_same(plus_reference, _diffusers(plus_path, "QwenImageEditPlusPipeline", PLUS))


def test_edit_plus_refuses_more_images_than_its_limit(plus_path: Path) -> None:
    from diffuserve.errors import InvalidRequestError

    pipe = load_pipeline(plus_path)
    assert pipe.max_image_inputs == 3
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(SamplingParams(prompt="x", width=64, height=64, image_inputs=(RED,) * 4))
    assert info.value.param == "image"
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(SamplingParams(prompt="x", width=64, height=64))
    assert info.value.param == "image"


def test_tiny_checkpoint_is_byte_identical_small_and_names_the_real_processor_class(
        edit_path: Path, tmp_path: Path) -> None:
    import json

    from diffuserve.models.tiny import build_tiny_checkpoint

    again = build_tiny_checkpoint("qwen-image-edit", tmp_path / "again")
    files = sorted(p.relative_to(edit_path) for p in edit_path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((edit_path / f).read_bytes() == (again / f).read_bytes() for f in files)
    assert sum((edit_path / f).stat().st_size for f in files) < 10 * 2**20
    # Saved through the torchvision-free substitute, named as the real class, with the video processor entry
    # the real class reads back.
    index = json.loads((edit_path / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    config = json.loads((edit_path / "processor" / "processor_config.json").read_text())
    assert config["processor_class"] == "Qwen2VLProcessor"
    assert config["video_processor"]["video_processor_type"] == "Qwen2VLVideoProcessor"
    # The system prompt of the template is exactly the 64 tokens the pipelines drop, as with the real tokenizer.
    import diffusers

    install_processor_substitutes()
    pipe = diffusers.QwenImageEditPipeline.from_pretrained(edit_path, local_files_only=True)
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    assert len(pipe.processor.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 64


RESIDENCY_PLANS = {
    # The DiT and the text encoder (Qwen2.5-VL with its vision tower) stream layer by layer.
    "layerwise": {"transformer": ("layerwise-offload", "dit"), "text_encoder": ("layerwise-offload", "text_encoder"),
                  "vae": ("component-offload", "vae")},
    "offload": {"transformer": ("component-offload", "dit"), "text_encoder": ("snapshot-offload", "text_encoder"),
                "vae": ("layerwise-offload", "vae")},
}


@pytest.mark.parametrize("plan_name", list(RESIDENCY_PLANS))
def test_edit_residency_modes_reproduce_the_resident_output(edit_native, edit_reference, plan_name: str) -> None:
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.pipelines.base import AllResident
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    plans = {name: ComponentPlan(name=name, group=group, mode=ResidencyMode(mode))
             for name, (mode, group) in RESIDENCY_PLANS[plan_name].items()}
    ledger = TransferLedger()
    edit_native.residency = build_residency(DeploymentPlan(components=plans), edit_native.components, device="cpu",
                                            ledger=ledger)
    try:
        ledger.begin_window()
        images = edit_native.run([EDIT]).outputs[0].images
        moved = {m.component for m in ledger.window_summary().moves}
    finally:
        edit_native.residency.close()
        edit_native.residency = AllResident()
    _assert_same(images, edit_reference)
    assert moved == set(plans)  # every component was really offloaded and brought back


# -- through a real server ---------------------------------------------------------------------------------


def _server(path: Path, name: str, logs: Path) -> ServerProcess:
    # Dynamic batching on, so the dispatch line shows why an edit runs alone. Warm-up stays on: an edit-only
    # model warms up with a gray input image.
    return ServerProcess(["--model-path", str(path), "--served-model-name", name, "--batching-mode", "dynamic",
                          "--batching-max-size", "4", "--batching-delay-ms", "50", "--enable-batching-metrics"], logs / "server.log")


@pytest.fixture(scope="module")
def edit_server(edit_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _server(edit_path, "tiny-qwen-edit", tmp_path_factory.mktemp("qwen-edit"))
    server.start(timeout_s=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plus_server(plus_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _server(plus_path, "tiny-qwen-edit-plus", tmp_path_factory.mktemp("qwen-edit-plus"))
    server.start(timeout_s=300)
    yield server
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _extra(params: SamplingParams) -> dict:
    return {"seed": params.seed, "num_inference_steps": params.num_inference_steps,
            "negative_prompt": params.negative_prompt, "true_cfg_scale": params.true_cfg_scale}


def test_openai_sdk_edit(edit_server: ServerProcess, edit_reference) -> None:
    start = len(edit_server.log())
    assert "warm-up generation" in edit_server.log()
    result = _client(edit_server).images.edit(image=("in.png", RED, "image/png"), prompt=PROMPT, n=2, size="64x64",
                                              extra_body=_extra(EDIT))
    _assert_same([decode_b64_png(d.b64_json) for d in result.data], edit_reference)
    wait_for_log(edit_server, r"stop_reason=head:image_conditioning", start=start)


def test_openai_sdk_edit_plus_with_an_image_list(plus_server: ServerProcess, plus_reference) -> None:
    client = _client(plus_server)
    # A list is sent as repeated `image[]` parts, as the SDK does for several images.
    result = client.images.edit(image=[("a.png", RED, "image/png"), ("b.png", BLUE_WIDE, "image/png")], prompt=PROMPT,
                                size="64x64", extra_body=_extra(PLUS))
    _assert_same([decode_b64_png(d.b64_json) for d in result.data], plus_reference)
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[("a.png", RED, "image/png")] * 4, prompt=PROMPT, size="64x64")
    assert info.value.body["param"] == "image" and "1 to 3 image files" in info.value.body["message"]
