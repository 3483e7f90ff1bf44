"""FLUX.1 ControlNet rows (`--controlnet`, `families/flux/controlnet.py`) on the tiny checkpoint with tiny ControlNets
in diffusers' layout (a single-purpose one and a ControlNet-Union).

Tolerance of every image comparison: 1/255 per channel (one uint8 step) on the decoded image, the issue's bar. The
references are diffusers' FluxControlNetPipeline on the same checkpoint, ControlNet and seed (a ControlNet row) and
the same request run alone (a row of a mixed batch)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import ControlRequest, SamplingParams

PIXEL_TOL = 1
SIZE = {"width": 32, "height": 32, "num_inference_steps": 4, "guidance_scale": 3.5}


def _png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def controlnets(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffuserve.families.flux.controlnet import build_tiny_flux_controlnet

    root = tmp_path_factory.mktemp("controlnets")
    return {
        "canny": build_tiny_flux_controlnet(tiny_flux_path, root / "canny", seed=0),
        "union": build_tiny_flux_controlnet(tiny_flux_path, root / "union", num_modes=4, seed=1),
    }


@pytest.fixture(scope="module")
def native(tiny_flux_path: Path, controlnets: dict[str, Path]):
    from diffuserve.models.controlnets import install_controlnets
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(tiny_flux_path)
    install_controlnets(pipe, [f"canny={controlnets['canny']}", f"u={controlnets['union']}"])
    return pipe


def _diff(a, b) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


def _params(prompt: str, seed: int, control: ControlRequest | None = None, **extra) -> SamplingParams:
    return SamplingParams(prompt=prompt, seed=seed, control=control, **{**SIZE, **extra})


# A control image of another size than the output (resized as diffusers resizes it), a union row, a row whose
# ControlNet stops at 3/4 of the steps, and CFG (the negative branch reuses the positive branch's residuals).
CASES = {
    "canny-window": _params("a cat", 1, ControlRequest(_png(0, 48, 40), name="canny", scale=0.8, end=0.75)),
    "union-mode-2": _params("a fox", 3, ControlRequest(_png(1, 32, 32), name="u", mode=2, scale=1.2, start=0.25)),
    "canny-cfg": _params(
        "a dog", 5, ControlRequest(_png(2, 32, 32), name="canny"), negative_prompt="blur", true_cfg_scale=2.0
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_controlnet_row_equals_diffusers_flux_controlnet_pipeline(case, native, tiny_flux_path, controlnets):
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    params = CASES[case]
    control = params.control
    net = FluxControlNetModel.from_pretrained(controlnets["canny" if control.name == "canny" else "union"])
    reference = FluxControlNetPipeline.from_pretrained(tiny_flux_path, controlnet=net, local_files_only=True)
    reference.set_progress_bar_config(disable=True)
    cfg = {}
    if params.cfg_enabled:
        cfg = {"negative_prompt": params.negative_prompt, "true_cfg_scale": params.true_cfg_scale}
    expected = reference(
        params.prompt,
        control_image=Image.open(io.BytesIO(control.image)).convert("RGB"),
        control_mode=control.mode,
        controlnet_conditioning_scale=control.scale,
        control_guidance_start=control.start,
        control_guidance_end=control.end,
        generator=torch.Generator().manual_seed(params.seed),
        max_sequence_length=reference.tokenizer_2.model_max_length,
        **SIZE,
        **cfg,
    ).images[0]
    got = native.run([params]).outputs[0].images[0]
    assert _diff(got, expected) <= PIXEL_TOL
    plain = native.run([_params(params.prompt, params.seed, **({} if not cfg else cfg))]).outputs[0].images[0]
    assert _diff(got, plain) > 10, "the ControlNet must change the image, or the comparison proves nothing"


def test_rows_with_different_controls_or_none_in_one_batch_each_equal_their_solo_run(native):
    batch = [
        CASES["canny-window"],
        _params("a plain bird", 7),
        CASES["union-mode-2"],
        _params("a boat", 9, ControlRequest(_png(3, 40, 32), name="canny", scale=0.4), n=2),
        _params("a plain tree", 11, ControlRequest(_png(4, 32, 32), name="u", mode=0, scale=0.0)),
    ]
    mixed = native.run(batch).outputs
    for params, output in zip(batch, mixed, strict=True):
        solo = native.run([params]).outputs[0]
        # Rows of another batch size run other GEMM blockings: equal within one 8-bit level, as every merged row.
        assert max(_diff(a, b) for a, b in zip(output.images, solo.images, strict=True)) <= PIXEL_TOL


def test_continuous_steps_mix_control_rows_at_different_steps(native):
    """A ControlNet row joining a running plain row (continuous batching: rows at different steps, each with its
    own step window) equals its solo run."""
    from diffuserve.pipelines import step_batch

    first, second = _params("a plain bird", 7), CASES["canny-window"]
    a = step_batch.start_request(native, first)
    step_batch.denoise_step(native, [a])
    b = step_batch.start_request(native, second)
    while b.step_index < len(b.state.timesteps):
        group = [r for r in (a, b) if r.step_index < len(r.state.timesteps)]
        step_batch.denoise_step(native, group)
    for rows, params in ((a, first), (b, second)):
        got = step_batch.finish_request(native, rows).images[0]
        assert _diff(got, native.run([params]).outputs[0].images[0]) <= PIXEL_TOL


def test_controlnet_rows_compose_with_per_row_lora(native, tiny_flux_path, tmp_path):
    """A row with a LoRA adapter and a control image beside a plain one and a control-only one: each equals its solo
    run (the adapter changes the base DiT's layers of its row; the ControlNet adds its residuals to them)."""
    from diffuserve.lora.registry import LoraRegistry
    from diffuserve.lora.slots import install_registry
    from diffuserve.lora.tiny import write_random_lora

    write_random_lora(tiny_flux_path, tmp_path / "style", rank=4, seed=3)
    registry = LoraRegistry({"style": str(tmp_path / "style")}, max_loras=2, host_capacity=2)
    install_registry(native, "flux", registry, max_rank=4, device="cpu", dtype=torch.float32)
    try:
        control = ControlRequest(_png(5, 32, 32), name="canny", scale=0.9)
        batch = [
            SamplingParams(prompt="a cat", seed=1, control=control, lora=(("style", 1.0),), **SIZE),
            _params("a plain bird", 7),
            _params("a cat", 1, control),
        ]
        mixed = native.run(batch).outputs
        solos = [native.run([p]).outputs[0].images[0] for p in batch]
        assert [_diff(m.images[0], s) for m, s in zip(mixed, solos, strict=True)] == [0, 0, 0]
        assert _diff(solos[0], solos[2]) > 0, "the adapter must change the control row"
    finally:
        native.lora = None


@pytest.mark.parametrize(
    ("control", "param", "words"),
    [
        (ControlRequest(b"x", name="u", mode=9), "control_mode", "9 is not one of its modes"),
        (ControlRequest(b"x", name="u"), "control_mode", "is missing"),
        (ControlRequest(b"x", name="canny", mode=1), "control_mode", "not a Union ControlNet"),
        (ControlRequest(b"x"), "controlnet", "several ControlNets are loaded"),
        (ControlRequest(b"x", name="depth"), "controlnet", "no ControlNet named 'depth'"),
        (ControlRequest(b"x", name="canny", scale=11.0), "controlnet_conditioning_scale", "must be in"),
        (ControlRequest(b"x", name="canny", start=0.8, end=0.5), "control_guidance_end", "start < end"),
    ],
)
def test_bad_control_fields_are_refused_naming_the_field(native, control, param, words):
    with pytest.raises(InvalidRequestError) as exc:
        native.validate(_params("a cat", 1, control))
    assert exc.value.param == param and words in exc.value.message


def test_a_step_cache_or_an_edit_with_a_control_image_is_refused(native):
    from diffuserve.config.step_cache import StepCacheSettings

    control = ControlRequest(b"x", name="canny")
    with pytest.raises(InvalidRequestError) as exc:
        native.validate(_params("a cat", 1, control, step_cache=StepCacheSettings(method="fbcache")))
    assert exc.value.param == "step_cache" and "refused for ControlNet rows" in exc.value.message
    with pytest.raises(InvalidRequestError) as exc:
        native.validate(_params("a cat", 1, control, image_inputs=(_png(0, 32, 32),), strength=0.6))
    assert exc.value.param == "control_image"


def test_the_controlnet_is_a_planned_component_offloaded_between_uses(tiny_flux_path, controlnets, native):
    """`--component-residency controlnet=component-offload`: the ControlNet is on the device only while its rows
    use it (moved for a ControlNet batch, never for a plain one), and the output equals the resident run."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.models.controlnets import install_controlnets
    from diffuserve.models.loader import load_pipeline
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    pipe = load_pipeline(tiny_flux_path)
    install_controlnets(pipe, [f"canny={controlnets['canny']}", f"u={controlnets['union']}"])
    ledger = TransferLedger()
    plan = DeploymentPlan(
        components={"controlnet": ComponentPlan(name="controlnet", group="other", mode=ResidencyMode.COMPONENT_OFFLOAD)}
    )
    pipe.use_residency(build_residency(plan, pipe.components, device="cpu", ledger=ledger))
    assert ledger.device_bytes("controlnet") == 0
    start = len(ledger.moves())
    pipe.run([_params("a plain bird", 7)])
    assert not [m for m in ledger.moves(start) if m.component == "controlnet"]
    start = len(ledger.moves())
    got = pipe.run([CASES["canny-window"]]).outputs[0].images[0]
    moved = [m for m in ledger.moves(start) if m.component == "controlnet"]
    assert moved and ledger.device_bytes("controlnet") == 0
    assert _diff(got, native.run([CASES["canny-window"]]).outputs[0].images[0]) == 0
