"""Tencent's Hunyuan3D-2 folder layout, read without torch (the registry and `diffuserve plan` use it).

A release is `<root>/<subfolder>/config.yaml` + `model.fp16.safetensors`, one subfolder per model:
`hunyuan3d-dit-v2-0`, `-fast`, `-turbo` under Hunyuan3D-2, `hunyuan3d-dit-v2-mini` (and its `-fast`/`-turbo`)
under Hunyuan3D-2mini, beside VAE-only and texture (`hunyuan3d-paint-*`) folders that are not shape models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.errors import CheckpointError

CONFIG = "config.yaml"
DIT_PREFIX = "hunyuan3d-dit-"


def shape_subfolders(root: Path) -> list[Path]:
    """The shape-model subfolders of a release root, sorted by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(DIT_PREFIX) and (p / CONFIG).is_file())


def looks_like_hunyuan3d(path: Path) -> bool:
    """`path` is a release root with shape subfolders, or one such subfolder."""
    path = Path(path)
    return bool(shape_subfolders(path)) or (path.name.startswith(DIT_PREFIX) and (path / CONFIG).is_file())


def find_subfolder(path: Path, model_id: str | None = None) -> Path:
    """The shape model to load: `path` itself when it holds config.yaml; else the subfolder of the root that
    `model_id` names (its last part, or variant words: mini, turbo, fast), else the plain 2.0 one (not mini, fast
    or turbo)."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    folders = shape_subfolders(path)
    if not folders:
        raise CheckpointError(
            f"{path} holds no {DIT_PREFIX}* subfolder with a {CONFIG}; pass a Hunyuan3D-2 "
            "release folder or one of its shape subfolders.",
            param="model_path",
        )
    wanted = (model_id or "").lower().rstrip("/")
    for folder in folders:
        if wanted and wanted.split("/")[-1] == folder.name:
            return folder
    mini = [f for f in folders if "-mini" in f.name] if "mini" in wanted else []
    if mini:
        folders = mini
    elif "mini" in wanted:
        raise CheckpointError(
            f"--model-id {model_id!r} asks for 2mini but {path} has only {[f.name for f in folders]}.", param="model_id"
        )
    for word in ("turbo", "fast"):
        if word in wanted:
            matches = [f for f in folders if f.name.endswith(word)]
            if matches:
                return matches[0]
            raise CheckpointError(
                f"--model-id {model_id!r} asks for the {word} variant but {path} has only {[f.name for f in folders]}.",
                param="model_id",
            )
    plain = [f for f in folders if not f.name.endswith(("-fast", "-turbo"))]
    plain = sorted(plain, key=lambda f: "-mini" in f.name)
    return (plain or folders)[0]


def read_config(folder: Path) -> dict[str, Any]:
    """config.yaml as a mapping (sections model, vae, conditioner, scheduler, image_processor)."""
    import yaml

    try:
        data = yaml.safe_load((folder / CONFIG).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{folder}/{CONFIG} could not be read ({exc}).", param="model_path") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{folder}/{CONFIG} is not a mapping of sections.", param="model_path")
    return data


def target_name(section: dict[str, Any]) -> str:
    """The class name at the end of a section's `target` path (`hy3dgen.shapegen.models.ShapeVAE` -> ShapeVAE)."""
    return str(section.get("target", "")).rsplit(".", 1)[-1]


COMPONENTS = {
    "model": ("dit", "Hunyuan3DDiT"),
    "vae": ("vae", "ShapeVAE"),
    "conditioner": ("image_encoder", "Dinov2Model"),
}
"""Weight prefix -> (deployment-plan group, class) of the three components the plan and residency see."""


def component_bytes(folder: Path) -> dict[str, int]:
    """Stored bytes per weight prefix (`model`, `vae`, `conditioner`), from the safetensors header only."""
    import json
    import struct

    sizes = dict.fromkeys(COMPONENTS, 0)
    path = folder / "model.fp16.safetensors"
    if not path.is_file():
        return sizes
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    for key, info in header.items():
        prefix = key.split(".", 1)[0]
        if prefix in sizes and isinstance(info, dict):
            start, end = info["data_offsets"]
            sizes[prefix] += end - start
    return sizes
