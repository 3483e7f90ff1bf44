"""SD3 and Qwen-Image ControlNet rows (`--controlnet` with an SD3ControlNetModel / QwenImageControlNetModel,
`families/sd3/controlnet.py`, `families/qwen_image/controlnet.py`) on the tiny checkpoints with tiny ControlNets in
the real layouts (FLUX.1's are in test_controlnet.py).

Tolerance: 1/255 per channel on the decoded image. References: diffusers' StableDiffusion3ControlNetPipeline and
QwenImageControlNetPipeline on the same checkpoint, ControlNet and seed (SD3's samples the control latents from
torch's global generator: the test seeds that with the request's seed, which is what the native rows draw from), and
each request run alone."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffuserve.sampling import ControlRequest, SamplingParams

PIXEL_TOL = 1


def _png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _diff(a, b) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


@pytest.fixture(scope="module")
def sd3_controlnet(tiny_sd3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffuserve.families.sd3.controlnet import build_tiny_sd3_controlnet

    return build_tiny_sd3_controlnet(tiny_sd3_path, tmp_path_factory.mktemp("sd3-cn") / "canny")


@pytest.fixture(scope="module")
def native(tiny_sd3_path: Path, sd3_controlnet: Path):
    from diffuserve.models.controlnets import install_controlnets
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(tiny_sd3_path)
    install_controlnets(pipe, [str(sd3_controlnet)])
    return pipe


def _params(prompt: str, seed: int, guidance: float, control: ControlRequest | None = None, **extra) -> SamplingParams:
    size = {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": guidance}
    return SamplingParams(prompt=prompt, seed=seed, control=control, **size, **extra)


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["cfg", "no-cfg"])
def test_an_sd3_controlnet_row_equals_diffusers_and_mixes_with_plain_rows(
    native, tiny_sd3_path, sd3_controlnet, guidance
):
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    control = ControlRequest(_png(0, 48, 40), scale=0.8, end=0.75)
    row = _params("a cat", 1, guidance, control)
    reference = StableDiffusion3ControlNetPipeline.from_pretrained(
        tiny_sd3_path, controlnet=SD3ControlNetModel.from_pretrained(sd3_controlnet), local_files_only=True
    )
    reference.set_progress_bar_config(disable=True)
    torch.manual_seed(row.seed)  # the pipeline samples the control latents from the global generator
    expected = reference(
        row.prompt,
        control_image=Image.open(io.BytesIO(control.image)).convert("RGB"),
        controlnet_conditioning_scale=control.scale,
        control_guidance_end=control.end,
        generator=torch.Generator().manual_seed(row.seed),
        max_sequence_length=native.adapter.max_sequence_length,
        width=64,
        height=64,
        num_inference_steps=4,
        guidance_scale=guidance,
    ).images[0]
    solo = native.run([row]).outputs[0].images[0]
    assert _diff(solo, expected) <= PIXEL_TOL
    batch = [
        row,
        _params("a dog", 2, guidance),
        _params("a boat", 3, guidance, ControlRequest(_png(1, 64, 64), scale=0.3, start=0.5), n=2),
    ]
    mixed = native.run(batch).outputs
    for params, output in zip(batch, mixed, strict=True):
        alone = native.run([params]).outputs[0]
        assert [_diff(a, b) <= PIXEL_TOL for a, b in zip(output.images, alone.images, strict=True)] == [True] * params.n
    assert _diff(mixed[0].images[0], mixed[1].images[0]) > 10


def test_sd3_continuous_steps_mix_control_rows_at_different_steps(native):
    from diffuserve.pipelines import step_batch

    first = _params("a plain bird", 7, 5.0)
    second = _params("a cat", 1, 5.0, ControlRequest(_png(2, 64, 64), scale=0.9, end=0.75))
    a = step_batch.start_request(native, first)
    step_batch.denoise_step(native, [a])
    b = step_batch.start_request(native, second)
    while b.step_index < len(b.state.timesteps):
        step_batch.denoise_step(native, [r for r in (a, b) if r.step_index < len(r.state.timesteps)])
    for rows, params in ((a, first), (b, second)):
        got = step_batch.finish_request(native, rows).images[0]
        assert _diff(got, native.run([params]).outputs[0].images[0]) <= PIXEL_TOL


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    from diffuserve.families.qwen_image.controlnet import build_tiny_qwen_image_controlnet
    from diffuserve.models.controlnets import install_controlnets
    from diffuserve.models.loader import load_pipeline

    base = tiny_checkpoint("qwen-image")
    net = build_tiny_qwen_image_controlnet(base, tmp_path_factory.mktemp("qwen-cn") / "union")
    pipe = load_pipeline(base)
    install_controlnets(pipe, [str(net)])
    return pipe, base, net


@pytest.mark.parametrize("true_cfg", [4.0, 1.0], ids=["cfg", "no-cfg"])
def test_a_qwen_image_controlnet_row_equals_diffusers_and_mixes_with_plain_rows(qwen, true_cfg):
    """Prompts of different token lengths in one batch: each row's ControlNet call sees its own tokens (padded with
    a mask within the group, as the DiT's rows are)."""
    from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline

    native, base, net = qwen
    size = {"width": 64, "height": 64, "num_inference_steps": 4, "true_cfg_scale": true_cfg, "negative_prompt": " "}
    control = ControlRequest(_png(0, 48, 40), scale=0.8, end=0.75)
    row = SamplingParams(prompt="a cat sitting on a long stone wall", seed=1, control=control, **size)
    reference = QwenImageControlNetPipeline.from_pretrained(
        base, controlnet=QwenImageControlNetModel.from_pretrained(net), local_files_only=True
    )
    reference.set_progress_bar_config(disable=True)
    expected = reference(
        row.prompt,
        control_image=Image.open(io.BytesIO(control.image)).convert("RGB"),
        controlnet_conditioning_scale=control.scale,
        control_guidance_end=control.end,
        generator=torch.Generator().manual_seed(row.seed),
        **size,
    ).images[0]
    solo = native.run([row]).outputs[0].images[0]
    assert _diff(solo, expected) <= PIXEL_TOL
    batch = [
        row,
        SamplingParams(prompt="a dog", seed=2, **size),
        SamplingParams(prompt="a boat", seed=3, control=ControlRequest(_png(1, 64, 64), scale=0.3, start=0.5), **size),
    ]
    mixed = native.run(batch).outputs
    for params, output in zip(batch, mixed, strict=True):
        assert _diff(output.images[0], native.run([params]).outputs[0].images[0]) <= PIXEL_TOL
    assert (
        _diff(mixed[0].images[0], native.run([SamplingParams(prompt=row.prompt, seed=1, **size)]).outputs[0].images[0])
        > 10
    )
