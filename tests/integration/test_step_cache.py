"""Step caches decide per row (`step_cache/hooks.py`): a row in a merged batch, or in a continuous group, equals
the same request alone with the same settings, while rows of one batch hit and miss at the same steps; a cached
image differs from the uncached one (steps really are skipped) yet stays close; the server takes the setting per
request (`step_cache`, `enable_teacache`) or from `--step-cache`, reports counts in `timings` and on `/metrics`,
and answers bad values with a 400 naming the field.

In-process checks use the demo FLUX checkpoint (`tiny_flux_path`); one shared server runs the HTTP checks with the
official openai SDK. Tolerance: 1/255 per pixel channel (the dynamic-batching tolerance).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest

from diffuserve.config.step_cache import parse_step_cache, with_calibration
from diffuserve.pipelines import step_batch
from diffuserve.sampling import SamplingParams
from tests.integration.helpers import decode_b64_png, metric_value, pixels
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running, wait_idle

PIXEL_TOL = 1
PROMPTS = ("a red circle in the top left", "a blue square in the bottom right", "a green triangle in the center")
SETTINGS = {  # per method, three rows with different options: they compute at different steps
    "fbcache": [{"threshold": 0.02}, {"threshold": 0.3}, {"threshold": 0.12, "max_cached_steps": 1}],
    "teacache": [{"threshold": 0.05}, {"threshold": 0.6}, {"threshold": 0.3}],
    "taylorseer": [{"refresh_interval": 1}, {"refresh_interval": 3, "order": 2}, {"refresh_interval": 2}],
    "magcache": [{"threshold": 0.01}, {"threshold": 0.3}, {"threshold": 0.1, "retention_ratio": 0.4}],
}


@pytest.fixture(scope="module")
def flux(tiny_flux_path: Path):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(tiny_flux_path)


@pytest.fixture(scope="module")
def calibration(flux, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo checkpoint's MagCache ratios, as `diffuserve calibrate-cache` writes them."""
    from diffuserve.tools.calibrate_cache import calibrate

    result = calibrate(flux, steps=10, prompts=PROMPTS[:2])
    assert len(result["mag_ratios"]) == 10 and result["mag_ratios"][0] == 1.0
    path = tmp_path_factory.mktemp("calibration") / "mag.json"
    path.write_text(json.dumps(result))
    return str(path)


def _params(method: str, steps: int = 10, calibration: str | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(
            prompt=prompt,
            width=64,
            height=64,
            num_inference_steps=steps,
            guidance_scale=0.0,
            seed=i,
            step_cache=with_calibration(parse_step_cache({"method": method, **options}), calibration),
        )
        for i, (prompt, options) in enumerate(zip(PROMPTS, SETTINGS[method], strict=True))
    ]


def _max_diff(a, b) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_rows_of_a_merged_batch_equal_their_requests_alone(flux, calibration, method: str) -> None:
    batch = _params(method, calibration=calibration)
    merged = flux.run(batch)
    counts = [output.step_cache for output in merged.outputs]
    # Rows decided differently at the same steps: some computed while others reused.
    assert len({c["computed_steps"] for c in counts}) > 1, counts
    assert any(c["reused_steps"] > 0 for c in counts), counts
    for params, output in zip(batch, merged.outputs, strict=True):
        alone = flux.run([params]).outputs[0]
        assert alone.step_cache == output.step_cache
        assert _max_diff(output.images[0], alone.images[0]) <= PIXEL_TOL


@pytest.mark.parametrize("batched_cfg", [False, True])
def test_cfg_branches_of_a_row_decide_together(flux, batched_cfg: bool) -> None:
    """True CFG, as two passes or one doubled batch: each row's branches follow the conditional branch's decision,
    and merged rows still equal their requests alone."""
    batch = [dataclasses.replace(p, negative_prompt="blurry", true_cfg_scale=3.0) for p in _params("fbcache")]
    flux.batched_cfg = batched_cfg
    try:
        merged = flux.run(batch).outputs
        assert len({o.step_cache["computed_steps"] for o in merged}) > 1
        for params, output in zip(batch, merged, strict=True):
            alone = flux.run([params]).outputs[0]
            assert alone.step_cache == output.step_cache
            assert _max_diff(output.images[0], alone.images[0]) <= PIXEL_TOL
    finally:
        flux.batched_cfg = False


@pytest.mark.parametrize("method", ["fbcache", "taylorseer"])
def test_rows_of_a_continuous_group_equal_their_requests_alone(flux, method: str) -> None:
    batch = _params(method)
    group = step_batch.start_requests(flux, batch[:1])
    conds = step_batch.GroupConds()
    for _ in range(3):  # the others join three steps later: the group mixes rows at different steps
        step_batch.denoise_step(flux, group, conds)
    group += step_batch.start_requests(flux, batch[1:])
    while not all(rows.done for rows in group):
        step_batch.denoise_step(flux, [rows for rows in group if not rows.done], conds)
    outputs = step_batch.finish_requests(flux, group)
    for params, output in zip(batch, outputs, strict=True):
        alone = flux.run([params]).outputs[0]
        assert alone.step_cache == output.step_cache
        assert _max_diff(output.images[0], alone.images[0]) <= PIXEL_TOL


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_cached_output_skips_steps_and_stays_close(flux, calibration, method: str) -> None:
    params = _params(method, steps=20, calibration=calibration)[1]
    cached = flux.run([params]).outputs[0]
    plain = flux.run([dataclasses.replace(params, step_cache=None)]).outputs[0]
    assert cached.step_cache["reused_steps"] > 0 and plain.step_cache is None
    a, b = (np.asarray(x.images[0]).astype(np.float64) for x in (cached, plain))
    mse = float(((a - b) ** 2).mean())
    assert mse > 0, "a reused step changed nothing: the cache did not skip"
    assert 10 * np.log10(255**2 / mse) > 25, "the cached image drifted far from the uncached one"


# -- over HTTP ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_server(
    tiny_flux_path: Path, calibration: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Dynamic batching of 3 with a server default of fbcache and a MagCache calibration; `StepHold.MARKER` prompts
    wait at their steps."""
    logs = tmp_path_factory.mktemp("step-cache")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--served-model-name",
            "tiny-flux-cache",
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "3",
            "--batching-delay-ms",
            "200",
            "--max-queue-size",
            "0",
            "--step-cache-calibration",
            calibration,
            "--step-cache",
            "fbcache",
            "--step-cache-config",
            json.dumps({"threshold": 0.2, "warmup_steps": 1}),
        ],
        logs / "server.log",
        env=StepHold(logs).env(),
    )
    server.start()
    yield server
    server.stop()


def _generate(
    server: ServerProcess, prompt: str, seed: int, size: str = "64x64", **extra: object
) -> tuple[np.ndarray, dict]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    result = client.images.generate(
        model="tiny-flux-cache",
        prompt=prompt,
        size=size,
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": 8, **extra},
    )
    return pixels(decode_b64_png(result.data[0].b64_json)), result.model_extra["timings"]


def test_server_default_request_field_and_metrics(cache_server: ServerProcess) -> None:
    before = metric_value(
        cache_server.base_url, "diffuserve_step_cache_steps_total", {"method": "fbcache", "outcome": "reused"}
    )
    _, default = _generate(cache_server, PROMPTS[0], 1)
    assert default["step_cache"]["method"] == "fbcache"
    assert default["step_cache"]["computed_steps"] + default["step_cache"]["reused_steps"] == 8
    _, off = _generate(cache_server, PROMPTS[0], 1, step_cache="off")
    assert off.get("step_cache") is None
    _, tea = _generate(cache_server, PROMPTS[0], 1, enable_teacache=True)
    assert tea["step_cache"]["method"] == "teacache"
    _, taylor = _generate(cache_server, PROMPTS[0], 1, step_cache={"method": "taylorseer", "refresh_interval": 2})
    assert taylor["step_cache"]["reused_steps"] > 0
    _, mag = _generate(cache_server, PROMPTS[0], 1, step_cache={"method": "magcache", "threshold": 0.3})
    assert mag["step_cache"]["method"] == "magcache" and mag["step_cache"]["reused_steps"] > 0
    after = metric_value(
        cache_server.base_url, "diffuserve_step_cache_steps_total", {"method": "fbcache", "outcome": "reused"}
    )
    assert after - before == default["step_cache"]["reused_steps"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"step_cache": "deepcache"}, "step_cache"),
        ({"step_cache": {"method": "fbcache", "threshold": 99}}, "step_cache"),
        ({"step_cache": {"method": "taylorseer", "colour": 1}}, "step_cache"),
        ({"step_cache": {"method": "magcache", "mag_ratios": [1.0]}}, "step_cache"),
        ({"step_cache": 7}, "step_cache"),
        ({"enable_teacache": True, "step_cache": "fbcache"}, "enable_teacache"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(cache_server: ServerProcess, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        _generate(cache_server, "bad", 1, **extra)
    assert raised.value.body["param"] == param, raised.value.body


def _wait(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        time.sleep(0.05)


def test_merged_requests_equal_their_requests_alone_over_http(cache_server: ServerProcess) -> None:
    """Three requests with different thresholds meet in the queue behind a held one and run as one batch."""
    options = [{"method": "fbcache", **o} for o in SETTINGS["fbcache"]]
    alone = [_generate(cache_server, p, i, step_cache=o) for i, (p, o) in enumerate(zip(PROMPTS, options, strict=True))]
    hold = StepHold(cache_server.log_path.parent)
    hold.arm()
    wait_idle(cache_server)
    with ThreadPoolExecutor(4) as pool:
        try:
            held = pool.submit(_generate, cache_server, f"held {StepHold.MARKER}", 9, size="32x32")
            _wait(lambda: running(cache_server))
            futures = [
                pool.submit(_generate, cache_server, p, i, step_cache=o)
                for i, (p, o) in enumerate(zip(PROMPTS, options, strict=True))
            ]
            _wait(lambda: metric_value(cache_server.base_url, "diffuserve_queue_depth") == 3)
        finally:
            hold.release()
        held.result()
        merged = [f.result() for f in futures]
    assert {t["batch_size"] for _, t in merged} == {3}
    assert len({t["step_cache"]["computed_steps"] for _, t in merged}) > 1
    for (image, timings), (image_alone, timings_alone) in zip(merged, alone, strict=True):
        assert timings["step_cache"] == timings_alone["step_cache"]
        assert _max_diff(image, image_alone) <= PIXEL_TOL


# -- every native family whose denoiser has repeated blocks ---------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "sana", "qwen-image", "z-image", "wan", "ltx2", "hunyuan-video-1.5"])
def test_other_native_families_decide_per_row(tiny_checkpoint, family: str) -> None:
    """The same hooks cut every family's blocks (its spec's layer containers): merged rows equal alone; teacache,
    whose coefficients are published for FLUX.1 only, is refused naming the field and the family that has them."""
    from diffuserve.errors import InvalidRequestError
    from diffuserve.models.loader import load_pipeline

    pipeline = load_pipeline(tiny_checkpoint(family))
    d = pipeline.defaults
    batch = [
        SamplingParams(
            prompt=f"prompt {i}",
            width=d.width,
            height=d.height,
            num_frames=d.num_frames,
            num_inference_steps=6,
            guidance_scale=d.guidance_scale,
            true_cfg_scale=d.true_cfg_scale,
            negative_prompt=d.negative_prompt,
            seed=i,
            step_cache=parse_step_cache({"method": "fbcache", "threshold": threshold}),
        )
        for i, threshold in enumerate((0.01, 2.0))
    ]
    for params in batch:
        pipeline.validate(params)
    merged = pipeline.run(batch).outputs
    assert merged[0].step_cache != merged[1].step_cache
    for params, output in zip(batch, merged, strict=True):
        alone = pipeline.run([params]).outputs[0]
        first = (output.videos[0] if output.videos else output.images)[0]
        first_alone = (alone.videos[0] if alone.videos else alone.images)[0]
        assert alone.step_cache == output.step_cache
        assert _max_diff(first, first_alone) <= PIXEL_TOL
    with pytest.raises(InvalidRequestError, match="FluxTransformer2DModel") as raised:
        pipeline.validate(dataclasses.replace(batch[0], step_cache=parse_step_cache("teacache")))
    assert raised.value.param == "step_cache"


def test_continuous_server_reports_each_requests_own_counts(
    tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Continuous batching over HTTP: requests with different settings step in one group; each answer equals the
    same request run alone on the same server, counts included."""
    logs = tmp_path_factory.mktemp("step-cache-continuous")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--served-model-name",
            "tiny-flux-cache",
            "--batching-mode",
            "continuous",
            "--batching-max-size",
            "3",
            "--step-cache",
            "taylorseer",
        ],
        logs / "server.log",
    ).start()
    options = [{"method": "taylorseer", **o} for o in SETTINGS["taylorseer"]]
    try:
        alone = [_generate(server, PROMPTS[i], i, step_cache=options[i]) for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda i: _generate(server, PROMPTS[i], i, step_cache=options[i]), range(3)))
    finally:
        server.stop()
    assert max(t["batch_size"] for _, t in together) > 1
    assert len({t["step_cache"]["computed_steps"] for _, t in together}) > 1
    for (image, timings), (image_alone, timings_alone) in zip(together, alone, strict=True):
        assert timings["step_cache"] == timings_alone["step_cache"]
        assert _max_diff(image, image_alone) <= PIXEL_TOL


def test_layerwise_offload_streams_no_block_a_step_reuses(flux, tiny_flux_path: Path) -> None:
    """Under layer-wise offload (set up at load, before any cached request: the step-cache hooks sit outside the
    streaming hooks), a step on which every row reuses moves no block weights: the ledger shows the bytes saved,
    and the images equal the resident ones."""
    import torch

    from diffuserve.config.plan import ComponentPlan, ResidencyMode
    from diffuserve.models.loader import load_pipeline
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import ComponentResidencyManager

    pipeline = load_pipeline(tiny_flux_path)
    ledger = TransferLedger()
    manager = ComponentResidencyManager(
        {"transformer": pipeline.adapter.transformer},
        {"transformer": ComponentPlan("transformer", "dit", ResidencyMode.LAYERWISE_OFFLOAD)},
        device=torch.device("cpu"),
        ledger=ledger,
    )
    manager.setup()
    pipeline.residency = manager

    def moved() -> int:
        return sum(sum(d.values()) for d in ledger.totals().values())

    batch = [
        dataclasses.replace(p, step_cache=parse_step_cache({"method": "taylorseer", "refresh_interval": 3}))
        for p in _params("taylorseer", steps=12)[:2]
    ]
    try:
        start = moved()
        plain = pipeline.run([dataclasses.replace(p, step_cache=None) for p in batch]).outputs
        middle = moved()
        cached = pipeline.run(batch).outputs
        end = moved()
    finally:
        manager.close()
    assert all(o.step_cache["reused_steps"] == 6 for o in cached)
    assert end - middle < 0.75 * (middle - start), (middle - start, end - middle)
    for params, output in zip(batch, cached, strict=True):
        assert _max_diff(output.images[0], flux.run([params]).outputs[0].images[0]) <= PIXEL_TOL
    for params, output in zip(batch, plain, strict=True):
        resident = flux.run([dataclasses.replace(params, step_cache=None)]).outputs[0]
        assert _max_diff(output.images[0], resident.images[0]) <= PIXEL_TOL
