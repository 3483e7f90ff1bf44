"""Native HunyuanVideo 1.5 facts beyond the conformance suite (test_family_conformance.py: diffusers parity for T2V
and I2V, merged rows, continuous joins, residency): bad input over HTTP with the official client (nothing queued),
a served video equal to the in-process run, the video VAE's resident layers, step caches per row, `flow_shift`
and a distilled (meanflow) I2V DiT against diffusers, a CFG continuous join.

Tolerances: 0/255 against the resident run (same process, same kernels); the served MP4 decodes to exactly the
pixels of the same encode of the in-process frames.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from diffuserve.config.plan import ResidencyMode
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.sampling import build_sampling_params
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks its video methods deprecated

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2}


def _png(seed: int = 0, size: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def t2v(tiny_checkpoint, family_pipeline):
    return family_pipeline(tiny_checkpoint("hunyuan-video-1.5"))


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("hv15")
    proc = ServerProcess(
        ["--model-path", str(tiny_checkpoint("hunyuan-video-1.5")), "--served-model-name", "tiny-hv15"],
        logs / "server.log",
    )
    proc.start(timeout_s=300)
    yield proc
    proc.stop()


def _jobs(server: ServerProcess) -> int:
    return len(httpx.get(f"{server.base_url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"])


def test_bad_input_is_a_400_naming_the_field_and_nothing_is_queued(server: ServerProcess) -> None:
    """A frame count the VAE's 2x time stride cannot take (with the nearest valid counts), a size off the 4-pixel
    grid (the VAE's 4x space times the DiT's patch 1), an image on the text-to-video checkpoint."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    before = _jobs(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="x", size="32x32", extra_body={"num_frames": 4})  # type: ignore[arg-type]
    assert err.value.body["param"] == "num_frames" and "use 3 or 5" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="x", size="34x32")  # type: ignore[arg-type]
    assert err.value.body["param"] == "size" and "multiple of 4" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="x", size="32x32", input_reference=("in.png", _png(), "image/png"))  # type: ignore[arg-type]
    assert err.value.body["param"] == "input_reference"
    assert _jobs(server) == before  # every refused create left nothing behind


def test_served_video_equals_the_in_process_run(server: ServerProcess, t2v) -> None:
    from diffuserve.media.video import decode_frames, encode_mp4

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    video = client.videos.create_and_poll(
        prompt="a red fox",
        size="32x32",
        extra_body={"seed": 3, "num_frames": 5},  # type: ignore[arg-type]
    )
    assert video.status == "completed", video
    served = client.videos.download_content(video.id).read()
    params = build_sampling_params(t2v.describe_model(), prompt="a red fox", seed=3, width=32, height=32, num_frames=5)
    frames = t2v.run([params]).outputs[0].videos[0]
    assert len(frames) == 5
    # The same frames through the same encoder decode to the same pixels.
    want = decode_frames(encode_mp4(frames, fps=params.fps))
    got = decode_frames(served)
    assert len(got) == len(want) == 5
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want, strict=True))


def test_video_vae_resident_layers_equal_the_resident_run(t2v) -> None:
    """`--layerwise-resident-layers vae=N` / `--layerwise-residency-lifetime vae=forward|permanent`: the streamed,
    forward-resident and permanent-resident VAE decode equal the resident run; a resident set moves once per request
    (forward) or never (permanent), a streamed decoder block moves in each request."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime
    from diffuserve.runtime.residency import build_residency

    params = build_sampling_params(t2v.describe_model(), prompt="a red kite", seed=4, **SMALL)
    reference = t2v.run([params]).outputs[0].videos
    blocks = len(t2v.adapter.vae.decoder.up_blocks)
    moved: dict[str, int] = {}
    for label, resident, lifetime in (
        ("streamed", 0, Lifetime.FORWARD),
        ("forward", blocks, Lifetime.FORWARD),
        ("permanent", blocks, Lifetime.PERMANENT),
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
        manager = build_residency(plan, {"vae": t2v.adapter.vae}, device="cpu", ledger=ledger)
        previous, t2v.residency = t2v.residency, manager
        try:
            ledger.begin_window()
            got = t2v.run([params]).outputs[0].videos
            moved[label] = sum(
                m.nbytes
                for m in ledger.window_summary().moves
                if m.direction == "h2d" and (m.layer or "").startswith("decoder.up_blocks")
            )
        finally:
            t2v.residency = previous
            manager.close()
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got[0], reference[0], strict=True))
    decoder_bytes = sum(p.numel() * p.element_size() for p in t2v.adapter.vae.decoder.up_blocks.parameters())
    assert moved["streamed"] >= decoder_bytes  # the ledger: each streamed block's bytes, in every request
    assert moved["forward"] == decoder_bytes  # placed once when the VAE's stage begins
    assert moved["permanent"] == 0  # placed at set-up, never moved per request


def test_video_vae_selector_flags_plan_and_equal_the_resident_run(t2v, tiny_checkpoint, capsys) -> None:
    """The seed's spelling, `--layerwise-resident-layers video_vae=1 --layerwise-residency-lifetime video_vae=forward`
    (with `--component-residency video_vae=layerwise-offload`; on a CPU host `auto` keeps everything resident):
    `diffuserve plan` shows the VAE layer-wise with one resident layer for the forward, and the VAE set up from the
    plan those flags resolve to decodes the resident run's frames exactly, its blocks moving through the ledger."""
    from diffuserve import cli
    from diffuserve.config.deployment import DeploymentArgs
    from diffuserve.config.plan import DeploymentPlan, Lifetime
    from diffuserve.hardware import detect_hardware
    from diffuserve.launch.setup import resolve_deployment
    from diffuserve.runtime.residency import build_residency

    path = tiny_checkpoint("hunyuan-video-1.5")
    flags = {
        "component_residency": ["video_vae=layerwise-offload"],
        "layerwise_resident_layers": ["video_vae=1"],
        "layerwise_residency_lifetime": ["video_vae=forward"],
    }
    argv = [arg for name, items in flags.items() for arg in ("--" + name.replace("_", "-"), *items)]
    assert cli.main(["plan", "--model-path", str(path), *argv]) == 0
    shown = capsys.readouterr().out
    row = next(line.split() for line in shown.splitlines() if line.split()[:1] == ["vae"])
    assert row[4:8] == ["layerwise-offload", "1", "1", "forward"], row  # mode, prefetch, resident layers, lifetime
    assert "--layerwise-resident-layers video_vae=1, --layerwise-residency-lifetime video_vae=forward" in shown

    plan = resolve_deployment(
        DeploymentArgs(**flags), path, model_id=None, dtype="float32", hardware=detect_hardware("cpu")
    )
    vae = plan.components["vae"]
    assert (vae.mode, vae.resident_layers, vae.lifetime) == (ResidencyMode.LAYERWISE_OFFLOAD, 1, Lifetime.FORWARD)
    params = build_sampling_params(t2v.describe_model(), prompt="a red kite", seed=5, **SMALL)
    reference = t2v.run([params]).outputs[0].videos
    ledger = TransferLedger()
    manager = build_residency(
        DeploymentPlan(components={"vae": vae}), {"vae": t2v.adapter.vae}, device="cpu", ledger=ledger
    )
    previous, t2v.residency = t2v.residency, manager
    try:
        ledger.begin_window()
        got = t2v.run([params]).outputs[0].videos
        moves = [m for m in ledger.window_summary().moves if m.direction == "h2d" and m.component == "vae"]
    finally:
        t2v.residency = previous
        manager.close()
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got[0], reference[0], strict=True))
    assert any((m.layer or "").startswith("decoder.up_blocks") and m.nbytes > 0 for m in moves)


def test_taylorseer_and_calibrated_magcache_decide_per_row(t2v) -> None:
    """TaylorSeer and MagCache (with this checkpoint's own calibration, `calibrate-cache`) over the DiT's
    `transformer_blocks`: rows with different settings in one batch each equal their run alone, counts included
    (fbcache: test_step_cache.py's per-family check)."""
    import dataclasses

    from diffuserve.config.step_cache import parse_step_cache
    from diffuserve.tools.calibrate_cache import calibrate

    steps = 6
    ratios = calibrate(t2v, steps=steps)["mag_ratios"]
    assert len(ratios) == steps
    base = build_sampling_params(t2v.describe_model(), prompt="x", seed=0, **{**SMALL, "num_inference_steps": steps})
    for method, options in (
        ("taylorseer", ({"refresh_interval": 1}, {"refresh_interval": 3, "order": 2})),
        ("magcache", ({"threshold": 0.01}, {"threshold": 0.5, "retention_ratio": 0.2})),
    ):
        # The server fills a magcache row's ratios from --step-cache-calibration; here they are set directly.
        extra = {"mag_ratios": tuple(ratios)} if method == "magcache" else {}
        settings = [dataclasses.replace(parse_step_cache({"method": method, **o}), **extra) for o in options]
        batch = [
            dataclasses.replace(base, prompt=f"a kite {i}", seed=i, step_cache=cache)
            for i, cache in enumerate(settings)
        ]
        merged = t2v.run(batch).outputs
        assert merged[0].step_cache != merged[1].step_cache, method
        for params, output in zip(batch, merged, strict=True):
            alone = t2v.run([params]).outputs[0]
            assert alone.step_cache == output.step_cache
            diff = np.abs(
                np.stack([np.asarray(f, dtype=np.int16) for f in output.videos[0]])
                - np.stack([np.asarray(f, dtype=np.int16) for f in alone.videos[0]])
            ).max()
            assert diff <= 1, (method, params.step_cache)


def test_flow_shift_equals_diffusers_with_that_static_shift(t2v, tiny_checkpoint, diffusers_pipeline) -> None:
    """A request's `flow_shift` runs what diffusers runs when its FlowMatchEuler scheduler has that shift (1/255)."""
    from diffuserve.pipelines.batch_rows import scheduler_template
    from tests.integration.family_checks import max_pixel_diff
    from tests.integration.family_references import Subject, hunyuan_video_15_reference

    assert "flow_shift" in t2v.request_fields()
    fields = {"prompt": "a cat surfing", "seed": 3, "guidance_scale": 3.0, **SMALL, "num_inference_steps": 3}
    params = build_sampling_params(t2v.describe_model(), **fields, flow_shift=2.5)
    ours = t2v.run([params]).outputs[0].videos
    path = tiny_checkpoint("hunyuan-video-1.5")
    pipe = diffusers_pipeline("HunyuanVideo15Pipeline", path)
    original, pipe.scheduler = pipe.scheduler, scheduler_template(pipe.scheduler, 2.5)
    try:
        theirs = hunyuan_video_15_reference(Subject(t2v, path, diffusers_pipeline), params)
    finally:
        pipe.scheduler = original
    assert max_pixel_diff(ours, theirs) <= 1
    unshifted = t2v.run([build_sampling_params(t2v.describe_model(), **fields)]).outputs[0].videos
    assert max_pixel_diff(ours, unshifted) > 0, "flow_shift did not reach the schedule"


def test_continuous_join_with_cfg_and_glyph_texts_equals_each_run_alone(t2v) -> None:
    """The suite's continuous check runs the tiny checkpoint's default (guidance 1, no CFG); here CFG with negative
    prompts, a quoted glyph text (ByT5 mask) and texts of different lengths join a running group (<= 1/255)."""
    from diffuserve.sampling import SamplingParams
    from tests.integration.family_checks import max_pixel_diff, simulate_steps
    from tests.integration.family_references import outputs_of

    common = {"width": 32, "height": 32, "num_frames": 5, "guidance_scale": 3.0}
    a = SamplingParams(prompt="a red square", negative_prompt="dark", seed=1, num_inference_steps=3, **common)
    b = SamplingParams(prompt='a long prompt about a blue sign saying "OPEN"', seed=2, num_inference_steps=2, **common)
    got = simulate_steps(t2v, {0: [a], 1: [b]})
    for i, params in enumerate([a, b]):
        assert max_pixel_diff(got[i], outputs_of(t2v, t2v.run([params]).outputs[0])) <= 1, i


def test_meanflow_i2v_equals_diffusers(tiny_checkpoint, tmp_path) -> None:
    """A distilled (`use_meanflow`) I2V DiT takes the next timestep as `timestep_r`, as diffusers' I2V pipeline
    passes it (1/255): the tiny I2V checkpoint with its transformer rebuilt under `use_meanflow=True`."""
    import shutil

    import diffusers
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel
    from PIL import Image

    from diffuserve.models.loader import load_pipeline
    from tests.integration.family_checks import max_pixel_diff
    from tests.integration.family_references import Subject, hunyuan_video_15_i2v_reference

    path = tmp_path / "meanflow"
    shutil.copytree(tiny_checkpoint("hunyuan-video-1.5-i2v"), path)
    config = dict(HunyuanVideo15Transformer3DModel.load_config(path / "transformer"))
    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel.from_config({**config, "use_meanflow": True}).eval()
    shutil.rmtree(path / "transformer")
    transformer.save_pretrained(path / "transformer")
    native = load_pipeline(path)
    params = build_sampling_params(
        native.describe_model(), prompt="a cat", seed=3, guidance_scale=1.0, image_inputs=(_png(1),), **SMALL
    )
    ours = native.run([params]).outputs[0].videos
    pipe = diffusers.HunyuanVideo15ImageToVideoPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        theirs = hunyuan_video_15_i2v_reference(Subject(native, path, lambda _c, _p: pipe), params)
    assert max_pixel_diff(ours, theirs) <= 1
    assert Image.open(io.BytesIO(params.image_inputs[0])).size == (32, 32)  # the tiny target size's bucket
