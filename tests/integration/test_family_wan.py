"""Native Wan facts beyond the conformance suite (test_family_conformance.py: diffusers parity for Wan2.1,
Wan2.2 A14B, TI2V-5B and I2V, merged rows, continuous joins and residency): A14B's experts under offload,
the request fields a checkpoint cannot run, I2V's image rules, and the video VAE's resident layers.

Tolerance: 0/255 per pixel against the resident run.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffuserve.config.plan import ResidencyMode
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.sampling import build_sampling_params
from tests.integration.family_checks import max_pixel_diff, with_residency

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3}


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoint, family_pipeline):
    return {name: family_pipeline(tiny_checkpoint(name)) for name in ("wan", "wan2.2", "wan-i2v")}


def _png(seed: int = 0) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


def _params(pipe, prompt: str, seed: int, **extra):
    return build_sampling_params(pipe.describe_model(), prompt=prompt, seed=seed, **{**SMALL, **extra})


def test_offloaded_experts_hold_the_device_one_at_a_time(pipelines):
    """`--component-residency transformer=component-offload transformer_2=component-offload`: only the active
    expert is on the device; the ledger shows each expert onloaded once, the high-noise one first."""
    pipe = pipelines["wan2.2"]
    params = _params(pipe, "a red kite", 4, guidance_scale=3.0, num_inference_steps=8)
    experts = ("transformer", "transformer_2")
    ledger = TransferLedger()
    seen: list[set[str]] = []

    def run():
        return (
            pipe.run([params], on_step=lambda i, n: seen.append({e for e in experts if ledger.device_bytes(e) > 0}))
            .outputs[0]
            .videos
        )

    with_residency(pipe, dict.fromkeys(experts, ResidencyMode.COMPONENT_OFFLOAD), run, ledger)
    assert all(len(on) == 1 for on in seen), seen
    assert seen[0] == {"transformer"} and seen[-1] == {"transformer_2"}
    onloads = [m for m in ledger.moves() if m.direction == "h2d" and m.component in experts]
    assert [m.component for m in onloads] == ["transformer", "transformer_2"]
    assert all(m.nbytes > 0 for m in onloads)  # bytes per request: each expert's weights once


def test_sizes_and_frames_the_checkpoint_cannot_run_are_refused(pipelines):
    from diffuserve.errors import InvalidRequestError

    pipe = pipelines["wan"]
    for fields, param in (
        ({"width": 1024, "height": 1024}, "size"),
        ({"num_frames": 4}, "num_frames"),
        ({"guidance_scale_2": 2.0}, "guidance_scale_2"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            _params(pipe, "x", 0, **fields)
        assert err.value.param == param


def test_wan_i2v_image_rules(pipelines):
    """(Its residency modes: the suite.)"""
    from diffuserve.errors import InvalidRequestError

    pipe = pipelines["wan-i2v"]
    assert "image_encoder" in pipe.components
    with pytest.raises(InvalidRequestError) as err:
        _params(pipe, "no image", 0)
    assert err.value.param == "input_reference"
    with pytest.raises(InvalidRequestError) as err:  # a text-to-video model takes no image
        _params(pipelines["wan"], "x", 0, image_inputs=(_png(),))
    assert err.value.param == "input_reference"


def test_video_vae_resident_layers_move_once_per_request_not_once_per_chunk(pipelines):
    """The Wan VAE decodes one latent frame (chunk) at a time, so streamed decoder blocks move once per chunk;
    a `forward` resident set moves once per request, a `permanent` one never (placed at set-up). Outputs
    equal the resident run."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime
    from diffuserve.pipelines.base import AllResident
    from diffuserve.runtime.residency import build_residency

    pipe = pipelines["wan"]
    params = _params(pipe, "a red kite", 4, guidance_scale=1.0, num_frames=9)  # 3 latent frames = 3 decoder chunks
    run = lambda: pipe.run([params]).outputs[0].videos  # noqa: E731
    reference = run()
    decoder_blocks = len(pipe.adapter.vae.decoder.up_blocks)
    per_request: dict[str, int] = {}
    for label, resident, lifetime in (
        ("streamed", 0, Lifetime.FORWARD),
        ("forward", decoder_blocks, Lifetime.FORWARD),
        ("permanent", decoder_blocks, Lifetime.PERMANENT),
    ):
        plan = DeploymentPlan(
            components={
                "vae": ComponentPlan(
                    name="vae",
                    group="vae",
                    mode=ResidencyMode.LAYERWISE_OFFLOAD,
                    resident_layers=resident,
                    lifetime=lifetime,
                )
            }
        )
        ledger = TransferLedger()
        pipe.residency = build_residency(plan, pipe.components, device="cpu", ledger=ledger)
        try:
            ledger.begin_window()
            assert max_pixel_diff(run(), reference) == 0, label
            summary = ledger.window_summary()
        finally:
            pipe.residency.close()
            pipe.residency = AllResident()
        per_request[label] = sum(
            m.nbytes for m in summary.moves if m.direction == "h2d" and (m.layer or "").startswith("decoder.up_blocks")
        )
    decoder_bytes = sum(p.numel() * p.element_size() for p in pipe.adapter.vae.decoder.up_blocks.parameters())
    assert per_request["streamed"] >= 3 * decoder_bytes  # every chunk re-streams the decoder blocks
    assert per_request["forward"] == decoder_bytes  # placed once when the VAE's stage begins
    assert per_request["permanent"] == 0  # placed at set-up, never moved per request
