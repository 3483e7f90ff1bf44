"""Step-level batching in-process: every request stepped in a shared group equals its singleton `run`.

Requests join the running group at several step offsets and with different step counts, so each transformer
call mixes rows at different timesteps. Tolerance: 1/255 per pixel channel (the dynamic-batching tolerance).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diffuserve.pipelines import step_batch
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import simulate_steps as _simulate

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255


@pytest.fixture(scope="module")
def flux(tiny_flux_path: Path):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(tiny_flux_path)


def _max_diff(a, b) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


def test_flux_declares_continuous(flux) -> None:
    assert flux.supports_continuous is True


def test_rows_joining_at_different_steps_equal_their_singleton_runs(flux) -> None:
    size = flux.defaults.width
    a = SamplingParams(prompt="a red square", seed=1, width=size, height=size, num_inference_steps=4)
    b = SamplingParams(prompt="a blue circle", seed=2, width=size, height=size, num_inference_steps=3, n=2)
    c = SamplingParams(prompt="green", seed=3, width=size, height=size, num_inference_steps=2)
    d = SamplingParams(prompt="a red square", seed=4, width=size, height=size, num_inference_steps=4)
    got = _simulate(flux, {0: [a], 1: [b], 3: [c, d]})  # joins at offsets 0, 1 and 3; c starts as a leaves
    for i, params in enumerate([a, b, c, d]):
        alone = flux.run([params]).outputs[0].images
        assert len(got[i]) == params.n == len(alone)
        for x, y in zip(got[i], alone, strict=True):
            assert _max_diff(x, y) <= PIXEL_TOL, f"request {i} differs from its singleton run"


def test_cfg_rows_equal_their_singleton_runs(flux) -> None:
    size = flux.defaults.width
    kw = {"width": size, "height": size, "true_cfg_scale": 2.0, "negative_prompt": "blurry"}
    a = SamplingParams(prompt="a cat", seed=5, num_inference_steps=3, **kw)
    b = SamplingParams(prompt="a dog", seed=6, num_inference_steps=2, **kw)
    got = _simulate(flux, {0: [a], 1: [b]})
    for i, params in enumerate([a, b]):
        assert _max_diff(got[i][0], flux.run([params]).outputs[0].images[0]) <= PIXEL_TOL


# Every continuous family's join equals its singleton runs, and the families that are not continuous say so:
# the family conformance suite (test_family_conformance.py).


def test_wan22_experts_split_a_step_whose_rows_straddle_the_boundary(tiny_checkpoint) -> None:
    """The mixed group of the family test above really mixes A14B's experts: at global step 1 the first request
    (3 steps) is past the boundary while the joiner (2 steps) is still at its first, high-noise step."""
    from diffuserve.models.loader import load_pipeline

    pipeline = load_pipeline(tiny_checkpoint("wan2.2"))
    d = pipeline.defaults
    kw = {"width": d.width, "height": d.height, "num_frames": d.num_frames, "guidance_scale": d.guidance_scale}
    a = step_batch.start_request(pipeline, SamplingParams(prompt="a", seed=1, num_inference_steps=3, **kw))
    b = step_batch.start_request(pipeline, SamplingParams(prompt="b", seed=2, num_inference_steps=2, **kw))
    a.step_index = 1
    experts = {pipeline.denoiser_for_step(r.step_index, r.state.timesteps[r.step_index], r.state) for r in (a, b)}
    assert experts == {"transformer", "transformer_2"}


def test_side_lanes_beside_an_offloaded_loop_equal_the_singleton_runs(tiny_flux_path: Path) -> None:
    """Every component offloaded (text encoders and VAE component-offload, the DiT streamed layer by layer): a
    joiner's encode runs in the encode lane and a finished request's decode in the decode lane while this thread
    keeps stepping the group. The `hold:` marker makes each lane job wait until two more steps ran here, so the
    scopes surely overlap; an offloaded module used outside its scope would raise (the guard hooks)."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.models.loader import load_pipeline
    from diffuserve.pipelines.lanes import lanes_for
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    pipeline = load_pipeline(tiny_flux_path)
    size = pipeline.defaults.width
    a = SamplingParams(prompt="the long one", seed=1, width=size, height=size, num_inference_steps=40)
    b = SamplingParams(prompt="HOLD short", seed=2, width=size, height=size, num_inference_steps=2)
    c = SamplingParams(prompt="HOLD joiner", seed=3, width=size, height=size, num_inference_steps=2)
    alone = [pipeline.run([p]).outputs[0].images for p in (a, b, c)]
    modes = {
        "text_encoder": ResidencyMode.COMPONENT_OFFLOAD,
        "text_encoder_2": ResidencyMode.COMPONENT_OFFLOAD,
        "vae": ResidencyMode.COMPONENT_OFFLOAD,
        "transformer": ResidencyMode.LAYERWISE_OFFLOAD,
    }
    groups = {"text_encoder": "text_encoder", "text_encoder_2": "text_encoder", "vae": "vae", "transformer": "dit"}
    plan = DeploymentPlan(components={n: ComponentPlan(name=n, group=groups[n], mode=m) for n, m in modes.items()})
    pipeline.residency = build_residency(plan, pipeline.components, device="cpu", ledger=TransferLedger())
    overlap = lanes_for(pipeline)
    overlap.hold_marker = "HOLD"
    group = step_batch.start_requests(pipeline, [a, b])
    for _ in range(2):
        step_batch.denoise_step(pipeline, group)
    rows_b, group = group[1], group[:1]
    decode_b = overlap.decode.submit(
        lambda: step_batch.finish_requests(pipeline, [rows_b]), inputs=[rows_b], prompts=[b.prompt]
    )
    start_c = overlap.encode.submit(lambda: step_batch.start_requests(pipeline, [c]), prompts=[c.prompt])
    while not (decode_b.done() and start_c.done()) and not group[0].done:
        step_batch.denoise_step(pipeline, group)  # the lanes wait for these steps
        overlap.count_step()
    assert decode_b.result().steps_beside >= 2 and start_c.result().steps_beside >= 2
    group.append(start_c.result().value[0])
    got = {1: decode_b.result().value[0].images}
    while group:
        step_batch.denoise_step(pipeline, group)
        for rows in [r for r in group if r.done]:
            got[0 if rows.params is a else 2] = step_batch.finish_request(pipeline, rows).images
            group.remove(rows)
    for i in range(3):
        assert _max_diff(got[i][0], alone[i][0]) <= PIXEL_TOL, f"request {i} differs from its singleton run"


def test_a_streamed_dit_streams_once_per_step_for_the_whole_group(tiny_flux_path: Path) -> None:
    """Layer-wise DiT offload: one continuous step of a group of three requests (at different step offsets)
    moves each streamed layer onto the device exactly once, the same bytes as a step of one request."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.models.loader import load_pipeline
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    pipeline = load_pipeline(tiny_flux_path)
    size = pipeline.defaults.width
    ledger = TransferLedger()
    plan = DeploymentPlan(
        components={"transformer": ComponentPlan(name="transformer", group="dit", mode=ResidencyMode.LAYERWISE_OFFLOAD)}
    )
    pipeline.residency = build_residency(plan, pipeline.components, device="cpu", ledger=ledger)
    first = step_batch.start_requests(
        pipeline, [SamplingParams(prompt="a", seed=1, width=size, height=size, num_inference_steps=6)]
    )
    step_batch.denoise_step(pipeline, first)  # the first request is one step ahead of the others

    def streamed_in(group) -> list[tuple[str | None, int]]:
        since = ledger.moves()[-1].seq + 1 if ledger.moves() else 0
        step_batch.denoise_step(pipeline, group)
        return sorted(
            (m.layer or "", m.nbytes)
            for m in ledger.moves(since)
            if m.component == "transformer" and m.direction == "h2d"
        )

    alone = streamed_in(first)
    group = first + step_batch.start_requests(
        pipeline,
        [
            SamplingParams(prompt="b much longer prompt", seed=2, width=size, height=size, num_inference_steps=6),
            SamplingParams(prompt="c", seed=3, width=size, height=size, num_inference_steps=3),
        ],
    )
    together = streamed_in(group)
    layers = [layer for layer, _ in together if layer]
    assert layers and len(layers) == len(set(layers)), "a layer came onto the device more than once in one step"
    assert together == alone  # three requests' rows cost the transfers of one
