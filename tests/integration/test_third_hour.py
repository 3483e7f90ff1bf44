"""`generate` as the second newcomer ran it (issue 34 item 6): a one-shot run logs the default model and the plan
once (the plan in one line), never "ready to serve", and ends with the step cache's counts; a Hunyuan3D checkpoint
makes a mesh from `--image-path` alone, its progress bar counting its 2 steps as 2. Real `diffuserve` processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import trimesh

from tests.integration.test_family_hunyuan3d import object_png
from tests.serverproc import REPO


def _generate(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})},
    )


def test_a_one_shot_run_logs_once_and_ends_with_the_step_cache_counts(tmp_path: Path):
    """No --model-path: the embedded default model, installed into this test's cache folder."""
    out = _generate(
        "--prompt", "a red circle", "--seed", "5", "--num-inference-steps", "10",
        "--step-cache", "fbcache", "--step-cache-config", '{"threshold": 0.3}', "--output-path", "out",
        cwd=tmp_path, env={"DIFFUSERVE_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    stderr = out.stderr
    assert stderr.count("no --model-path: using the embedded default model") == 1, stderr
    assert "ready to serve" not in stderr and "Deployment plan (" not in stderr, stderr
    (plan,) = [line for line in stderr.splitlines() if "deployment plan:" in line]
    assert "transformer resident" in plan and "`diffuserve plan`" in plan, plan
    counts = re.search(r"step cache fbcache: computed (\d+), reused (\d+) denoising steps", stderr)
    assert counts and int(counts[1]) + int(counts[2]) == 10 and int(counts[2]) > 0, stderr
    assert out.stdout.split() == ["out/a_red_circle.png"]


def test_a_mesh_from_an_image_alone_and_its_bar_counts_its_steps(tiny_checkpoint, tmp_path: Path):
    """As docs/api.md and docs/families.md show it: no --prompt (a mesh model is conditioned on the image)."""
    (tmp_path / "in.png").write_bytes(object_png())
    out = _generate("--model-path", str(tiny_checkpoint("hunyuan3d")), "--image-path", "in.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["outputs/in.glb"]
    mesh = trimesh.load(tmp_path / "outputs" / "in.glb", force="mesh")
    assert len(mesh.vertices) > 0 and len(mesh.faces) > 0
    # The tiny checkpoint runs 2 DiT steps: the bar never shows more than its total, and spaces its unit.
    shown = re.findall(r"(\d+)/(\d+) steps", out.stderr)
    assert shown and all(int(n) <= int(total) == 2 for n, total in shown), out.stderr[-2000:]
    assert ("2", "2") in shown and not re.search(r"\dstep", out.stderr), out.stderr[-2000:]


def test_make_tiny_and_calibrate_cache_print_no_torchvision_fallback_notes(tmp_path: Path):
    """transformers notes, per image-processor class, that it falls back to the PIL processor without torchvision;
    those are the processors we use, so the notes are noise (shown with --log-level debug where one exists)."""
    made = subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "make-tiny", "--output", str(tmp_path / "flux")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    calibrated = subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "calibrate-cache", "--model-path", str(tmp_path / "flux"),
         "--output", str(tmp_path / "mag.json"), "--steps", "4", "--prompt", "a cat"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert calibrated.returncode == 0, calibrated.stderr[-3000:]
    for out in (made, calibrated):
        assert "requires torchvision" not in out.stderr and "Loading weights" not in out.stderr, out.stderr[-3000:]
