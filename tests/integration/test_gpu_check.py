"""`benchmarks/gpu_check.sh` (issue 28 item 7) cannot rot: on this CPU machine the script itself exits 0 with its
one "no CUDA device" line, and its Python runs every path (DiT per method, native vs diffusers pipeline, CFG
parallel over two gloo processes) on tiny shapes on the CPU (`--device cpu --tiny`)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_the_script_says_no_cuda_device_and_exits_0() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.strip().splitlines()
    assert line == "gpu_check: no CUDA device; nothing measured (run it on a CUDA machine).", done.stdout


def test_every_path_runs_on_tiny_shapes_on_the_cpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # importable by name: the spawned CFG ranks import it
    gpu_check = importlib.import_module("gpu_check")
    argv = ["--device", "cpu", "--tiny", "--steps", "1", "--pipeline-steps", "1", "--cfg-ranks", "2"]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.count(" | ") >= 1]
    dit = [r for r in rows if r[0] in ("flux", "wan")]
    assert [(r[0], r[1], r[2]) for r in dit] == [
        (family, method, kernel)
        for family in ("flux", "wan")
        for method, kernel in (
            ("float32", "-"),
            ("fp8", "weight-only"),
            ("int8", "weight-only"),
            ("int8-dynamic", "int8-dynamic"),
        )
    ]
    for family in ("flux", "wan"):  # the quantized DiT holds fewer bytes than the unquantized one
        weights = {r[1]: float(r[3]) for r in dit if r[0] == family}
        assert all(weights[m] < weights["float32"] for m in ("fp8", "int8", "int8-dynamic")), weights
    assert [r[0] for r in rows if r[0] in ("native", "diffusers")] == ["native", "diffusers"]
    assert [r[0] for r in rows if r[0].startswith(("1 device", "CFG parallel"))] == [
        "1 device, both branches",
        "CFG parallel, 2 ranks",
    ]
    assert all(float(r[-1]) > 0 for r in rows[1:] if r[-1].replace(".", "").isdigit())
