"""Tencent's Hunyuan3D-2 folder layout, read without torch: which subfolder a --model-path / --model-id pair names,
and what the registry and the plan make of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffuserve.errors import CheckpointError
from diffuserve.family_spec.hunyuan3d_layout import component_bytes, find_subfolder, looks_like_hunyuan3d

NAMES = ("hunyuan3d-dit-v2-0", "hunyuan3d-dit-v2-0-fast", "hunyuan3d-dit-v2-0-turbo", "hunyuan3d-dit-v2-mini")


def release(root: Path, names=NAMES) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text("model: {}\n")
    (root / "hunyuan3d-paint-v2-0").mkdir()  # a texture model beside them: never picked
    return root


@pytest.mark.parametrize(
    "model_id, expected",
    [
        (None, "hunyuan3d-dit-v2-0"),
        ("tencent/Hunyuan3D-2", "hunyuan3d-dit-v2-0"),
        ("tencent/Hunyuan3D-2/hunyuan3d-dit-v2-0-fast", "hunyuan3d-dit-v2-0-fast"),
        ("Hunyuan3D-2-turbo", "hunyuan3d-dit-v2-0-turbo"),
        ("tencent/Hunyuan3D-2mini", "hunyuan3d-dit-v2-mini"),
    ],
)
def test_the_model_id_picks_the_subfolder(tmp_path: Path, model_id, expected):
    root = release(tmp_path / "Hunyuan3D-2")
    assert find_subfolder(root, model_id).name == expected
    assert find_subfolder(root / expected).name == expected  # the subfolder itself
    assert looks_like_hunyuan3d(root) and looks_like_hunyuan3d(root / expected)


def test_a_missing_variant_or_folder_is_an_error_naming_what_there_is(tmp_path: Path):
    root = release(tmp_path / "r", names=("hunyuan3d-dit-v2-0",))
    with pytest.raises(CheckpointError, match="turbo") as turbo:
        find_subfolder(root, "Hunyuan3D-2-turbo")
    assert turbo.value.param == "model_id" and "hunyuan3d-dit-v2-0" in turbo.value.message
    with pytest.raises(CheckpointError, match="hunyuan3d-dit-"):
        find_subfolder(tmp_path / "empty")
    assert not looks_like_hunyuan3d(tmp_path / "empty")


def test_registry_and_plan_read_the_layout(tmp_path: Path):
    import json
    import struct

    from diffuserve.config.model_profiles import profile_from_checkpoint
    from diffuserve.models.registry import resolve_model

    root = release(tmp_path / "r", names=("hunyuan3d-dit-v2-0",))
    header = {
        "model.a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]},
        "vae.b": {"dtype": "F16", "shape": [2], "data_offsets": [8, 12]},
        "conditioner.c": {"dtype": "F16", "shape": [1], "data_offsets": [12, 14]},
    }
    blob = json.dumps(header).encode()
    (root / "hunyuan3d-dit-v2-0" / "model.fp16.safetensors").write_bytes(
        struct.pack("<Q", len(blob)) + blob + bytes(14)
    )
    spec = resolve_model(root)
    assert (spec.family, spec.backend) == ("hunyuan3d", "native")
    assert component_bytes(root / "hunyuan3d-dit-v2-0") == {"model": 8, "vae": 4, "conditioner": 2}
    profile = profile_from_checkpoint(root)
    assert profile.family == "hunyuan3d" and profile.kind == "mesh"
    assert {k: c.group for k, c in profile.components.items()} == {
        "model": "dit",
        "vae": "vae",
        "conditioner": "image_encoder",
    }


def test_the_plan_sees_the_dit_blocks_layer_wise_offload_streams(tmp_path: Path):
    import json
    import struct

    from diffuserve.config.model_profiles import profile_from_checkpoint

    root = release(tmp_path / "r", names=("hunyuan3d-dit-v2-0",))
    keys = ["model.latent_in.weight", "model.double_blocks.0.w", "model.single_blocks.0.w", "model.single_blocks.1.w"]
    keys += ["vae.transformer.resblocks.0.w", "conditioner.c"]
    header = {k: {"dtype": "F16", "shape": [2], "data_offsets": [4 * i, 4 * i + 4]} for i, k in enumerate(keys)}
    blob = json.dumps(header).encode()
    (root / "hunyuan3d-dit-v2-0" / "model.fp16.safetensors").write_bytes(
        struct.pack("<Q", len(blob)) + blob + bytes(4 * len(keys))
    )
    dit = profile_from_checkpoint(root).components["model"]
    assert dit.has_layers and dit.layer_container_paths == ("double_blocks", "single_blocks")
    assert (dit.num_layers, dit.layers_bytes, dit.param_bytes) == (3, 12, 16)
