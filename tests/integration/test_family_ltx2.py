"""Native LTX-2 facts beyond the conformance suite (test_family_conformance.py: its frames against LTX2Pipeline and
LTX2ImageToVideoPipeline, merged rows, residency and layer-wise offload): the sound.

Tolerances: frames 1/255 per pixel, waveforms 1e-4 (float32 on CPU; observed ~1e-7), against the diffusers pipeline
on the same tiny checkpoint and seeds, or against the same request run alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import build_sampling_params
from tests.integration.family_checks import max_pixel_diff
from tests.integration.family_references import Subject, _uint8_frames, ltx2_call, png

AUDIO_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def native(tiny_checkpoint, family_pipeline):
    return family_pipeline(tiny_checkpoint("ltx2"))


@pytest.fixture(scope="module")
def subject(native, tiny_checkpoint, diffusers_pipeline) -> Subject:
    return Subject(native=native, path=tiny_checkpoint("ltx2"), diffusers=diffusers_pipeline)


def _params(native: Any, *, generate_audio: bool | None = None, **fields: Any):
    """A request through THE builder (the model's checks run); `generate_audio` set on the result (the API field
    is the MP4 helper's part of the issue)."""
    params = build_sampling_params(native.describe_model(), **fields)
    if generate_audio is not None:
        params = dataclasses.replace(params, generate_audio=generate_audio)
        native.validate(params)
    return params


def _max_audio_diff(ours: list[torch.Tensor], theirs: Any) -> float:
    assert len(ours) == len(theirs)
    return max(float((a - b.float()).abs().max()) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "a cat surfing", "seed": 3, "negative_prompt": "blurry"},
        {"prompt": "a cat", "seed": 2, "guidance_scale": 4.0, "fps": 12, "image_inputs": (png(32, 32),)},
    ],
    ids=["t2v", "i2v"],
)
def test_waveform_equals_the_diffusers_pipeline(native, subject: Subject, fields: dict[str, Any]) -> None:
    """The vocoder's waveform, one (channels, samples) float32 per video at the vocoder's rate, equals what
    LTX2Pipeline (LTX2ImageToVideoPipeline for an input image) returns as `audio`; the frames too."""
    params = _params(native, **fields)
    (out,) = native.run([params]).outputs
    theirs = ltx2_call(subject, params)
    assert out.audio_sample_rate == native.adapter.vocoder.config.output_sampling_rate
    assert [tuple(a.shape) for a in out.audios] == [tuple(a.shape) for a in theirs.audio]
    assert all(a.dtype == torch.float32 and a.ndim == 2 for a in out.audios)
    assert _max_audio_diff(out.audios, theirs.audio) <= AUDIO_TOLERANCE
    assert max_pixel_diff(out.videos, [_uint8_frames(c) for c in theirs.frames]) <= 1
    assert float(out.audios[0].abs().max()) > 0  # a real waveform, not silence


def test_generate_audio_false_skips_the_audio_branch(native, subject: Subject, monkeypatch) -> None:
    """`generate_audio=False`: the audio VAE and the vocoder never run and no waveform comes back. The video is not
    the with-audio video (the joint model's video attends to the audio); it equals diffusers' pipeline with the
    transformer's modalities isolated (`isolate_modalities` forced on), where the video reads no audio at all."""
    calls: list[str] = []
    for module, method in (
        (native.adapter.audio_vae, "forward"),
        (native.adapter.audio_vae, "decode"),
        (native.adapter.vocoder, "forward"),
    ):
        monkeypatch.setattr(module, method, lambda *a, _n=method, **k: calls.append(_n))
    silent = _params(native, prompt="a red fox", seed=3, generate_audio=False)
    (out,) = native.run([silent]).outputs
    monkeypatch.undo()
    assert calls == [] and out.audios == [] and out.audio_sample_rate is None
    reference = subject.diffusers("LTX2Pipeline", subject.path)
    forward = reference.transformer.forward
    monkeypatch.setattr(
        reference.transformer, "forward", lambda *a, **k: forward(*a, **{**k, "isolate_modalities": True})
    )
    theirs = ltx2_call(subject, silent)
    monkeypatch.undo()
    assert max_pixel_diff(out.videos, [_uint8_frames(c) for c in theirs.frames]) <= 1
    (with_audio,) = native.run([_params(native, prompt="a red fox", seed=3)]).outputs
    assert max_pixel_diff(out.videos, with_audio.videos) > 0  # the joint model's video did read its audio


def test_merged_rows_carry_their_own_audio(native) -> None:
    """Rows of one batch with their own seed, negative prompt, fps (so their own audio length), n and input image:
    each video and waveform equals the request run alone."""
    batch = [
        _params(native, prompt="a cat", seed=1),
        _params(native, prompt="a dog on a beach", seed=2, n=2, negative_prompt="dark", fps=12),
        _params(native, prompt="a cat", seed=5, image_inputs=(png(32, 32, seed=1),)),
    ]
    merged = native.run(batch).outputs
    lengths = set()
    for params, out in zip(batch, merged, strict=True):
        (alone,) = native.run([params]).outputs
        assert len(out.audios) == params.n
        assert max_pixel_diff(out.videos, alone.videos) <= 1
        assert _max_audio_diff(out.audios, alone.audios) <= AUDIO_TOLERANCE
        lengths.add(out.audios[0].shape[-1])
    assert len(lengths) == 2  # fps 8 and 12: two audio lengths in one batch


@pytest.mark.parametrize("generate_audio", [None, False], ids=["audio", "silent"])
def test_continuous_join_carries_its_own_audio(native, generate_audio: bool | None) -> None:
    """A continuous group (`pipelines/step_batch.py`, as the engine steps it): b and c join after a's first step,
    so rows at different sigmas share each transformer call and the x0-space guidance; each request's frames and
    waveform equal its run alone (silent requests: no waveform)."""
    from tests.integration.family_checks import simulate_steps

    a = _params(native, prompt="a red square", seed=1, num_inference_steps=3, generate_audio=generate_audio)
    b = _params(native, prompt="a much longer prompt about a dog", seed=2, n=2, negative_prompt="dark")
    b = dataclasses.replace(b, num_inference_steps=2, generate_audio=generate_audio)
    c = _params(native, prompt="green", seed=3, num_inference_steps=2, generate_audio=generate_audio)
    outputs: dict[int, Any] = {}
    got = simulate_steps(native, {0: [a], 1: [b, c]}, whole=outputs)
    for i, params in enumerate([a, b, c]):
        (alone,) = native.run([params]).outputs
        assert max_pixel_diff(got[i], alone.videos) <= 1, f"request {i} differs from its singleton run"
        assert len(outputs[i].audios) == len(alone.audios) == (0 if generate_audio is False else params.n)
        if alone.audios:
            assert outputs[i].audio_sample_rate == alone.audio_sample_rate
            assert _max_audio_diff(outputs[i].audios, alone.audios) <= AUDIO_TOLERANCE


def test_bad_requests_are_refused_naming_the_field(native) -> None:
    """Before queueing (the request builder runs the model's checks): a frame count the VAE's temporal stride
    cannot take names `num_frames` and the nearest valid counts; a size off the 32 grid names `size`; two input
    images name `input_reference`."""
    step = native.frame_multiple
    with pytest.raises(InvalidRequestError) as frames:
        _params(native, prompt="x", num_frames=step + 2)
    assert frames.value.param == "num_frames"
    assert f"use {step + 1} or {2 * step + 1}" in str(frames.value)
    with pytest.raises(InvalidRequestError) as size:
        _params(native, prompt="x", width=48)
    assert size.value.param == "size"
    with pytest.raises(InvalidRequestError) as images:
        _params(native, prompt="x", image_inputs=(png(32, 32), png(32, 32, seed=1)))
    assert images.value.param == "input_reference"
    assert _params(native, prompt="x", generate_audio=False).generate_audio is False


def test_audio_length_follows_the_clip(native) -> None:
    """diffusers' rule: the audio lasts num_frames / fps seconds (its latents rounded), at the vocoder's rate."""
    params = _params(native, prompt="x", seed=0, fps=8)
    (out,) = native.run([params]).outputs
    seconds = out.audios[0].shape[-1] / out.audio_sample_rate
    assert abs(seconds - params.num_frames / params.fps) < 0.1
    assert np.isfinite(out.audios[0].numpy()).all() and float(out.audios[0].abs().max()) <= 1.0


def test_video_vae_layerwise_with_resident_layers_equals_resident(native) -> None:
    """`--component-residency vae=layerwise-offload` with `--layerwise-resident-layers vae=N` and each lifetime:
    the frames and the waveform equal the resident run; LTX-2's VAE decodes the whole clip in one call, so its
    streamed decoder blocks move once per request, a `forward` resident set once when the VAE's stage begins, a
    `permanent` one never (placed at set-up). The ledger's bytes per layer say so."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime, ResidencyMode
    from diffuserve.pipelines.base import AllResident
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    params = _params(native, prompt="a red kite", seed=4)
    reference = native.run([params]).outputs[0]
    blocks = len(native.adapter.vae.decoder.up_blocks)
    decoder_bytes = sum(p.numel() * p.element_size() for p in native.adapter.vae.decoder.up_blocks.parameters())
    moved: dict[str, int] = {}
    for label, resident, lifetime in (
        ("streamed", 0, Lifetime.FORWARD),
        ("forward", blocks, Lifetime.FORWARD),
        ("permanent", blocks, Lifetime.PERMANENT),
    ):
        component = ComponentPlan(
            name="vae", group="vae", mode=ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=resident, lifetime=lifetime
        )
        ledger = TransferLedger()
        native.residency = build_residency(
            DeploymentPlan(components={"vae": component}), native.components, device="cpu", ledger=ledger
        )
        try:
            ledger.begin_window()
            out = native.run([params]).outputs[0]
            summary = ledger.window_summary()
        finally:
            native.residency.close()
            native.residency = AllResident()
        assert max_pixel_diff(out.videos, reference.videos) == 0, label
        assert _max_audio_diff(out.audios, reference.audios) == 0, label
        moved[label] = sum(
            m.nbytes for m in summary.moves if m.direction == "h2d" and (m.layer or "").startswith("decoder.up_blocks")
        )
    assert moved == {"streamed": decoder_bytes, "forward": decoder_bytes, "permanent": 0}, moved


def test_ltx23_spatio_temporal_guidance_equals_diffusers(
    tiny_checkpoint, family_pipeline, diffusers_pipeline, monkeypatch
):
    """The STG pass (the perturbed self-attention of `STG_BLOCKS`) on the LTX-2.3 settings (perturbable attention,
    gated attention, registers in the connectors): diffusers' default block 28 is beyond the tiny model, so both
    sides perturb block 1 here; frames and waveform equal LTX2Pipeline's with `spatio_temporal_guidance_blocks=[1]`."""
    from diffuserve.families.ltx2 import layout

    path = tiny_checkpoint("ltx2.3")
    native = family_pipeline(path)
    subject = Subject(native=native, path=path, diffusers=diffusers_pipeline)
    monkeypatch.setattr(layout, "STG_BLOCKS", (1,))
    params = _params(native, prompt="a cat surfing", seed=7)
    assert native.adapter.guidance(params).stg == layout.STG_SCALE
    (out,) = native.run([params]).outputs
    theirs = ltx2_call(subject, params, spatio_temporal_guidance_blocks=[1])
    assert max_pixel_diff(out.videos, [_uint8_frames(c) for c in theirs.frames]) <= 1
    assert _max_audio_diff(out.audios, theirs.audio) <= AUDIO_TOLERANCE
