"""Which family a checkpoint belongs to, and which backend runs it.

A diffusers folder names its pipeline class in `model_index.json` (`_class_name`); that, or a
`--model-id` hint such as "black-forest-labs/FLUX.1-dev", picks the family. Families with a native
adapter run natively by default; every other diffusers pipeline runs through the diffusers backend.
No torch here: `diffuserve plan` resolves a model without importing it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuserve import family_spec
from diffuserve.errors import CheckpointError

logger = logging.getLogger(__name__)

BACKENDS = family_spec.BACKENDS

DEFAULTS_KEY = "_diffuserve_defaults"
"""model_index.json key where a checkpoint may suggest request defaults (width, height, num_frames,
num_inference_steps, guidance_scale, fps); diffusers ignores `_`-prefixed keys. Tiny video checkpoints use it so
they do not default to the 832x480x81 of the real model."""

_DEFAULT_FIELDS = {
    "width": int,
    "height": int,
    "num_frames": int,
    "num_inference_steps": int,
    "guidance_scale": float,
    "fps": int,
}


def native_families() -> dict[str, str]:
    """family -> "module:Class" of its native adapter, from the family specs."""
    return {name: spec.native_adapter for name, spec in family_spec.all_specs().items() if spec.native_adapter}


@dataclass(frozen=True)
class ModelSpec:
    """What the registry resolved for a checkpoint folder."""

    family: str = "unknown"
    """Family name (`flux`, `wan`, ...), or `unknown` when neither class nor id says."""
    pipeline_class: str = ""
    """model_index.json `_class_name` (the diffusers pipeline class)."""
    backend: str = "diffusers"
    """native | diffusers: the backend that will run it."""
    components: dict[str, tuple[str, str]] = field(default_factory=dict)
    """model_index.json key -> (library, class) for every non-null component."""
    model_path: Path = Path(".")
    """The checkpoint folder."""

    @property
    def output_kind(self) -> str:
        """image | video | mesh: what the family makes (images for a checkpoint no spec knows)."""
        known = family_spec.all_specs().get(self.family)
        return known.output_kind if known is not None else "image"


family_from_class = family_spec.family_from_class
family_from_model_id = family_spec.family_from_model_id


def read_model_index(model_path: Path) -> dict:
    """Parse `model_index.json`, raising CheckpointError naming the folder when it is absent or bad."""
    index_file = Path(model_path) / "model_index.json"
    if not Path(model_path).is_dir():
        raise CheckpointError(
            f"--model-path {model_path} is not a folder; pass a diffusers-format checkpoint folder "
            "(one that holds model_index.json).",
            param="model_path",
        )
    if not index_file.is_file():
        raise CheckpointError(
            f"checkpoint {model_path} has no model_index.json; pass the folder a diffusers pipeline was "
            "saved to (save_pretrained writes model_index.json at its root).",
            param="model_path",
        )
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {model_path}: model_index.json is not valid JSON ({exc}).") from exc
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise CheckpointError(
            f"checkpoint {model_path}: model_index.json has no string `_class_name` naming the diffusers "
            "pipeline class."
        )
    return index


def index_components(index: dict) -> dict[str, tuple[str, str]]:
    """model_index.json entries that are components: key -> (library, class); null entries skipped."""
    out: dict[str, tuple[str, str]] = {}
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, cls = value
        if library is None or cls is None:
            continue
        out[key] = (str(library), str(cls))
    return out


select_backend = family_spec.backend_for
"""native | diffusers for `family` under `--backend auto|native|diffusers` (the rule is the families')."""


def resolve_model(model_path: Path, *, model_id: str | None = None, backend: str = "auto") -> ModelSpec:
    """Read the folder's model_index.json and decide family and backend.

    The family follows `family_spec.family_for`: the class name wins over the model-id hint, because the
    folder is what will actually be loaded; the hint only names a family when the class is not one we know.
    """
    model_path = Path(model_path)
    if not (model_path / "model_index.json").is_file():
        from diffuserve.family_spec.hunyuan3d_layout import looks_like_hunyuan3d

        if looks_like_hunyuan3d(model_path):  # Tencent's own layout: no diffusers pipeline, a native family only
            return ModelSpec(
                family="hunyuan3d",
                pipeline_class="Hunyuan3DDiTFlowMatchingPipeline",
                backend=select_backend("hunyuan3d", "native" if backend == "auto" else backend),
                model_path=model_path,
            )
    index = read_model_index(model_path)
    class_name = index["_class_name"]
    family = family_spec.family_for(class_name, model_id)
    return ModelSpec(
        family=family,
        pipeline_class=class_name,
        backend=select_backend(family, backend),
        components=index_components(index),
        model_path=model_path,
    )


def read_suggested_defaults(model_path: Path) -> dict[str, Any]:
    """The checkpoint's `_diffuserve_defaults` from model_index.json, keeping only known, typed fields."""
    try:
        suggested = json.loads((Path(model_path) / "model_index.json").read_text()).get(DEFAULTS_KEY)
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(suggested, dict):
        return {}
    out: dict[str, Any] = {}
    for name, kind in _DEFAULT_FIELDS.items():
        value = suggested.get(name)
        # guidance_scale may be 0 (guidance-distilled models such as Z-Image-Turbo sample without it).
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and (value > 0 or (name == "guidance_scale" and value == 0)):
            out[name] = kind(value)
        elif value is not None:
            logger.warning("%s: ignoring %s.%s=%r (expected a positive number)", model_path, DEFAULTS_KEY, name, value)
    return out
