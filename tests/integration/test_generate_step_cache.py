"""`diffuserve generate --step-cache METHOD [--step-cache-config JSON] [--step-cache-calibration FILE]` (the flags
`serve` takes, declared once on EngineConfig): the written image equals the pipeline's own run with the same step
cache (pixel-exact: one process, one pipeline, the same request) and differs from the uncached one; a method the
family cannot run and a calibration file made for another family, another checkpoint or with an inconsistent step
count are refused at start-up, exit 2, naming the flag (`models/fingerprint.py`). Run in process through `cli.main`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffuserve import cli
from diffuserve.config.step_cache import parse_step_cache, with_calibration
from diffuserve.sampling import build_sampling_params

COMMON = ("--prompt", "a red circle in the top left", "--seed", "5", "--num-inference-steps", "10")


def _generate(capsys, model: Path, out: Path, *flags: str) -> tuple[int, str]:
    code = cli.main(["generate", "--model-path", str(model), "--output-path", str(out), *COMMON, *flags])
    return code, capsys.readouterr().err


def _written(out: Path) -> np.ndarray:
    (path,) = out.glob("*.png")
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


@pytest.fixture(scope="module")
def calibration(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`diffuserve calibrate-cache` on the tiny FLUX checkpoint (it records the family and the fingerprint)."""
    path = tmp_path_factory.mktemp("calibration") / "mag.json"
    flags = ["--model-path", str(tiny_flux_path), "--output", str(path), "--steps", "10", "--prompt", "a cat"]
    assert cli.main(["calibrate-cache", *flags]) == 0
    data = json.loads(path.read_text())
    assert data["family"] == "flux" and data["checkpoint"] and len(data["mag_ratios"]) == 10
    return path


def _reference(family_pipeline, model: Path, setting: dict, calibration: Path | None = None) -> np.ndarray:
    """The same request run on the pipeline in this process, the step cache set as serve's default would be."""
    pipeline = family_pipeline(model)
    cache = with_calibration(parse_step_cache(setting), str(calibration) if calibration else None)
    params = build_sampling_params(
        pipeline.describe_model(), prompt=COMMON[1], seed=5, num_inference_steps=10, step_cache=cache
    )
    output = pipeline.run([params]).outputs[0]
    assert output.step_cache["reused_steps"] > 0, output.step_cache  # the setting really skips steps
    return np.asarray(output.images[0].convert("RGB")).astype(np.int16)


@pytest.mark.parametrize(
    ("flags", "setting"),
    [
        (
            ["--step-cache", "taylorseer", "--step-cache-config", '{"refresh_interval": 3, "order": 2}'],
            {"method": "taylorseer", "refresh_interval": 3, "order": 2},
        ),
        (
            ["--step-cache", "fbcache", "--step-cache-config", '{"threshold": 0.3}'],
            {"method": "fbcache", "threshold": 0.3},
        ),
    ],
)
def test_generate_runs_the_step_cache_it_is_given(
    tiny_flux_path, tmp_path, capsys, family_pipeline, flags, setting
) -> None:
    code, err = _generate(capsys, tiny_flux_path, tmp_path / "cached", *flags)
    assert code == 0, err
    cached = _written(tmp_path / "cached")
    assert np.array_equal(cached, _reference(family_pipeline, tiny_flux_path, setting))
    code, err = _generate(capsys, tiny_flux_path, tmp_path / "plain")
    assert code == 0, err
    assert np.abs(cached - _written(tmp_path / "plain")).max() > 0  # steps were skipped: not the uncached image


def test_generate_runs_magcache_with_the_checkpoints_calibration(
    tiny_flux_path, tmp_path, capsys, family_pipeline, calibration
) -> None:
    flags = ["--step-cache", "magcache", "--step-cache-config", '{"threshold": 0.3}']
    code, err = _generate(capsys, tiny_flux_path, tmp_path, *flags, "--step-cache-calibration", str(calibration))
    assert code == 0, err
    reference = _reference(family_pipeline, tiny_flux_path, {"method": "magcache", "threshold": 0.3}, calibration)
    assert np.array_equal(_written(tmp_path), reference)


def _edited(calibration: Path, folder: Path, **changes) -> Path:
    path = folder / f"edited-{'-'.join(changes)}.json"
    path.write_text(json.dumps({**json.loads(calibration.read_text()), **changes}))
    return path


def test_a_calibration_the_checkpoint_cannot_use_is_refused_at_start_up(
    tiny_flux_path, tiny_wan_path, tmp_path, capsys, calibration, monkeypatch
) -> None:
    from diffuserve.models.tiny import ensure_default_model

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the calibration file was checked")

    monkeypatch.setattr("diffuserve.launch.setup.load_rank_pipeline", refuse)
    magcache = ["--step-cache", "magcache", "--step-cache-calibration"]
    other_flux = ensure_default_model(tmp_path / "cache")  # the demo model: FLUX too, other weights
    cases = [
        (tiny_wan_path, str(calibration), "calibrated on a flux checkpoint, and this server serves wan"),
        (other_flux, str(calibration), "calibrated on another checkpoint"),
        (tiny_flux_path, str(_edited(calibration, tmp_path, num_inference_steps=28)), "num_inference_steps=28"),
        (tiny_flux_path, str(_edited(calibration, tmp_path, mag_ratios=[1.0])), "at least 2 steps"),
    ]
    for model, path, says in cases:
        code, err = _generate(capsys, model, tmp_path / "out", *magcache, path)
        assert code == 2 and "--step-cache-calibration" in err and says in err, err
        assert "calibrate-cache --model-path" in err and "Traceback" not in err
    # serve refuses it too, before it loads anything (the same start-up check, prepare_rank).
    code = cli.main(["serve", "--model-path", str(other_flux), "--port", "0", *magcache, str(calibration)])
    err = capsys.readouterr().err
    assert code == 2 and "--step-cache-calibration" in err and "another checkpoint" in err, err


def test_generate_refuses_a_method_the_family_cannot_run(tiny_wan_path, tmp_path, capsys) -> None:
    code = cli.main(
        ["generate", "--model-path", str(tiny_wan_path), "--output-path", str(tmp_path), "--prompt", "x"]
        + ["--step-cache", "teacache"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--step-cache" in err and "teacache" in err and "fbcache" in err, err
