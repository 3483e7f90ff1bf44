"""Hunyuan3D-2 (image -> mesh) on the tiny release `make-tiny --family hunyuan3d` builds: loading Tencent's layout,
each variant, batched rows equal to their solo runs, residency modes, cancellation, request checks, mesh export."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from diffuserve.config.plan import ResidencyMode
from diffuserve.errors import InvalidRequestError, RequestCancelledError
from diffuserve.media.meshes import encode_mesh
from diffuserve.models.loader import load_pipeline
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import layered_components, with_residency

VOLUME_TOLERANCE = 1e-5
"""Batched vs solo: the DiT and decoder matmuls run with another batch size, so float32 sums may round
differently in the last bits (measured ~7e-7 on occupancy values of magnitude ~2); rows never mix."""


def object_png(color=(200, 50, 50), box=(20, 10, 70, 70)) -> bytes:
    """An RGBA image: an opaque ellipse on a transparent background (the object the preprocessing recentres)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (96, 80), (0, 0, 0, 0))
    ImageDraw.Draw(image).ellipse(box, fill=(*color, 255))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def release(tiny_checkpoint):
    return tiny_checkpoint("hunyuan3d")


@pytest.fixture(scope="module")
def pipe(release):
    return load_pipeline(release)


def _params(seed: int, png: bytes | None = None, **extra) -> SamplingParams:
    return SamplingParams(
        image_inputs=(png or object_png(),),
        num_inference_steps=2,
        guidance_scale=5.0,
        seed=seed,
        octree_resolution=24,
        **extra,
    )


def test_loads_tencents_layout_and_the_plain_model_by_default(pipe, release):
    from diffuserve.models import registry

    assert registry.resolve_model(release).family == "hunyuan3d"
    assert pipe.family == "hunyuan3d" and pipe.output_kind == "mesh"
    assert pipe.variant == "hunyuan3d-dit-v2-0" and not pipe.guidance_distilled
    assert set(pipe.components) == {"model", "vae", "conditioner"}
    # The tiny config's own `diffuserve:` section suggests small defaults.
    assert pipe.defaults.num_inference_steps == 2 and pipe.settings.default_octree_resolution == 32


@pytest.mark.parametrize(
    "model_id, variant, scheduler",
    [
        ("tencent/Hunyuan3D-2/hunyuan3d-dit-v2-0-fast", "hunyuan3d-dit-v2-0-fast", "FlowMatchEulerDiscreteScheduler"),
        ("Hunyuan3D-2-turbo", "hunyuan3d-dit-v2-0-turbo", "ConsistencyFlowMatchEulerDiscreteScheduler"),
        ("tencent/Hunyuan3D-2mini", "hunyuan3d-dit-v2-mini", "FlowMatchEulerDiscreteScheduler"),
    ],
)
def test_variants_load_by_model_id_and_make_meshes(release, model_id, variant, scheduler):
    pipe = load_pipeline(release, model_id=model_id)
    assert pipe.variant == variant and pipe.scheduler["kind"] == scheduler
    assert pipe.guidance_distilled == (variant.endswith(("fast", "turbo")))
    mesh = pipe.run([_params(3)]).outputs[0].meshes[0]
    assert mesh.error is None and len(mesh.vertices) > 0 and mesh.faces.max() < len(mesh.vertices)
    # The subfolder itself loads too.
    assert load_pipeline(release / variant).variant == variant


def test_batched_rows_equal_their_solo_runs(pipe):
    batch = [_params(1), _params(2, object_png((20, 200, 20), (10, 5, 80, 60))), _params(3)]
    stages: dict[str, float] = {}
    together = pipe.volumes(batch, stages)
    assert {"encode", "denoise", "volume_decode"} <= set(stages)
    for row, params in enumerate(batch):
        alone = pipe.volumes([params], {})
        assert torch.allclose(together[row], alone[0], atol=VOLUME_TOLERANCE, rtol=0), row
    # Different seeds give different shapes.
    assert not torch.allclose(together[0], together[2])
    meshes = [o.meshes[0] for o in pipe.run(batch).outputs]
    solo = pipe.run([batch[1]]).outputs[0].meshes[0]
    if meshes[1].vertices.shape == solo.vertices.shape:
        assert np.abs(meshes[1].vertices - solo.vertices).max() < 1e-4


def test_residency_modes_reproduce_the_resident_volume(pipe):
    run = lambda: pipe.volumes([_params(5)], {})  # noqa: E731
    reference = run()
    for mode in (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD):
        output, ledger = with_residency(pipe, dict.fromkeys(pipe.components, mode), run)
        assert torch.equal(output, reference), mode
        assert {m.component for m in ledger.moves()} == set(pipe.components), mode
    # Layer-wise: the DiT's double and single blocks stream one by one (the others offload whole); bit-equal.
    assert layered_components(pipe) == ["model"]
    modes = {name: ResidencyMode.COMPONENT_OFFLOAD for name in pipe.components}
    output, ledger = with_residency(pipe, {**modes, "model": ResidencyMode.LAYERWISE_OFFLOAD}, run)
    assert torch.equal(output, reference)
    streamed = [m.layer for m in ledger.moves() if m.component == "model" and m.layer and m.direction == "h2d"]
    blocks = [f"double_blocks.{i}" for i in range(len(pipe.model.double_blocks))]
    blocks += [f"single_blocks.{i}" for i in range(len(pipe.model.single_blocks))]
    # Every block of every step (2 steps, CFG rows in the same call), in execution order.
    assert streamed == blocks * 2, streamed


def test_cancel_between_steps_and_progress(pipe):
    seen: list[tuple[int, int]] = []
    pipe.run([_params(1)], on_step=lambda i, n: seen.append((i, n)))
    assert seen == [(0, 2), (1, 2)]  # the step index, as every pipeline (the engine counts i + 1 done)
    with pytest.raises(RequestCancelledError):
        pipe.run([_params(1)], should_stop=lambda: True)


def test_requests_are_checked_naming_the_field(pipe):
    with pytest.raises(InvalidRequestError) as two:
        pipe.validate(dataclasses.replace(_params(1), image_inputs=(object_png(), object_png())))
    assert two.value.param == "image"
    with pytest.raises(InvalidRequestError) as big:
        pipe.validate(dataclasses.replace(_params(1), octree_resolution=4096))
    assert big.value.param == "octree_resolution"


def test_mesh_export_glb_and_obj(pipe):
    import trimesh

    mesh = pipe.run([_params(1)]).outputs[0].meshes[0]
    glb = encode_mesh(mesh.vertices, mesh.faces, "glb")
    assert glb[:4] == b"glTF"
    loaded = trimesh.load(io.BytesIO(glb), file_type="glb", force="mesh")
    assert len(loaded.faces) == len(mesh.faces)
    obj = encode_mesh(mesh.vertices, mesh.faces, "obj").decode()
    assert obj.count("\nf ") + obj.startswith("f ") == len(mesh.faces)
    # Vertices lie in the [-box, box] cube.
    assert np.abs(mesh.vertices).max() <= pipe.settings.box + 1e-6


FLASHVDM_VS_DENSE = 0.15
"""FlashVDM vs the dense decode on the same points: its coarse level and each fine cell attend to only a third of
the latent tokens (5 of the tiny VAE's 16), so the logits differ by that approximation: measured mean abs
difference ~0.09 (max ~0.5) on logits of magnitude ~1.2 at octree 32 to 128. Real checkpoints (3072 tokens,
top 1024) approximate far more closely; the reference's own FlashVDM is the exact check
(tests/integration/test_hunyuan3d_reference.py)."""


def test_a_config_yaml_picks_the_volume_decoder(release, tmp_path):
    import shutil

    import yaml

    from diffuserve.errors import CheckpointError

    folder = tmp_path / "hunyuan3d-dit-v2-0-turbo"
    shutil.copytree(release / folder.name, folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    for choice, expected in (("dense", "dense"), ("auto", "flashvdm")):
        config["diffuserve"]["volume_decoder"] = choice
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        assert load_pipeline(folder).volume_decoder == expected
    config["diffuserve"]["volume_decoder"] = "fast"
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match="volume_decoder"):
        load_pipeline(folder)


def test_flashvdm_for_turbo_batched_and_against_dense(release):
    from diffuserve.families.hunyuan3d.adapter import extract_surface

    pipe = load_pipeline(release, model_id="Hunyuan3D-2-turbo")
    assert pipe.volume_decoder == "flashvdm"
    # Two levels on a small grid: a 16^3 coarse level, then 31^3 near its surface.
    pipe.settings = dataclasses.replace(pipe.settings, flashvdm_min_resolution=15)
    batch = [dataclasses.replace(p, octree_resolution=32) for p in (_params(1), _params(2))]
    together = pipe.volumes(batch, {})
    assert together.shape == (2, 31, 31, 31)
    alone = pipe.volumes(batch[1:], {})[0]
    assert torch.equal(torch.isnan(together[1]), torch.isnan(alone))
    assert torch.allclose(together[1].nan_to_num(), alone.nan_to_num(), atol=VOLUME_TOLERANCE, rtol=0)
    pipe.settings = dataclasses.replace(pipe.settings, volume_decoder="dense")
    dense = pipe.volumes([dataclasses.replace(batch[1], octree_resolution=30)], {})[0]
    queried = torch.isfinite(alone)
    assert (alone[queried] - dense[queried]).abs().mean() < FLASHVDM_VS_DENSE
    # Marching cubes makes NaN vertices on edges to unqueried points: those triangles are dropped.
    from skimage import measure

    axis = np.linspace(-1, 1, 31)
    x, y, z = np.meshgrid(axis, axis, axis, indexing="ij")
    volume = (0.6 - np.sqrt(x**2 + y**2 + z**2)).astype(np.float32)  # a ball, inside > 0
    volume[:, :, 20:] = np.nan
    assert np.isnan(measure.marching_cubes(volume, 0.0, method="lewiner")[0]).any()
    mesh = extract_surface(volume, level=0.0, box=1.01, resolution=32)
    assert len(mesh.faces) and np.isfinite(mesh.vertices).all() and mesh.faces.max() < len(mesh.vertices)
