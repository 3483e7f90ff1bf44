"""Equal to the reference: our Hunyuan3D-2 shape stage against Tencent's `hy3dgen` 2.0.2 on the tiny checkpoint.

The reference is installed once per session with `pip install --no-deps --target <tmp>` (plus its real needs
here: einops, opencv-python-headless) and runs in its own process with a small torchvision stand-in
(`hunyuan3d_reference/stubs`) on its path only; skipped, saying why, where it cannot be installed.

Tolerances: both sides get the same preprocessed image, so latents and the decoded volume agree to float32
rounding (atol 1e-4 on logits of magnitude ~2), and the marching-cubes vertices to 1e-4. The preprocessing itself
differs only by resampling filters (Pillow's box/bicubic vs OpenCV's area/cubic): mean abs difference < 0.02
on the [-1, 1] image.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diffuserve.families.hunyuan3d.conditioning import preprocess
from diffuserve.models.loader import load_pipeline
from diffuserve.sampling import SamplingParams
from tests.integration.test_family_hunyuan3d import object_png

HERE = Path(__file__).parent / "hunyuan3d_reference"
REFERENCE = ("hy3dgen==2.0.2", "einops", "opencv-python-headless")


@pytest.fixture(scope="session")
def reference_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("hy3dgen") / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), *REFERENCE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        pytest.skip(f"the reference package cannot be installed here ({' '.join(REFERENCE)}): {done.stderr[-500:]}")
    return site


@pytest.mark.parametrize("variant", ["hunyuan3d-dit-v2-0", "hunyuan3d-dit-v2-0-fast", "hunyuan3d-dit-v2-0-turbo"])
def test_volume_and_vertices_equal_hy3dgen(reference_site, tiny_checkpoint, tmp_path, variant):
    folder = tiny_checkpoint("hunyuan3d") / variant
    png_path = tmp_path / "object.png"
    png_path.write_bytes(object_png())
    pipe = load_pipeline(folder)
    image = preprocess(png_path.read_bytes(), pipe.image_size, pipe.border_ratio)
    np.save(tmp_path / "ours.npy", image.numpy())
    seed, steps, guidance, octree = 7, 3, 5.0, 24
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(reference_site), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "reference.npz"
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / "run_reference.py"),
            str(folder),
            str(png_path),
            str(tmp_path / "ours.npy"),
            str(seed),
            str(steps),
            str(guidance),
            str(octree),
            str(out),
            str(HERE / "stubs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = np.load(out)

    params = SamplingParams(
        image_inputs=(png_path.read_bytes(),),
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        octree_resolution=octree,
    )
    volume = pipe.volumes([params], {})[0].numpy()
    assert np.abs(volume - reference["volume"][0]).max() < 1e-4
    mesh = pipe.run([params]).outputs[0].meshes[0]
    assert mesh.vertices.shape == reference["vertices"].shape
    assert np.abs(mesh.vertices - reference["vertices"]).max() < 1e-4
    assert np.array_equal(mesh.faces, reference["faces"])
    # Preprocessing: same recentring and white background, other resampling filters.
    assert np.abs(image.numpy() - reference["own_image"]).mean() < 0.02
