"""What one checkpoint of a family is, from its configs alone (no weights, no torch).

`describe_checkpoint(spec, configs)` is THE place a checkpoint's static facts are derived: `diffuserve plan` calls it
on the JSON files of a folder (`read_checkpoint_configs`), a native adapter on the configs of its loaded modules
(`pipelines.base.component_configs`), so both see the same size multiple, size limit, defaults and capabilities.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuserve.family_spec.base import CheckpointConfigs, FamilySpec, LatentGeometry, SamplingDefaults

_CONFIG_FILES = ("config.json", "scheduler_config.json", "guider_config.json")
"""The config file of a component folder: a model's, a scheduler's or a guider's (HunyuanVideo 1.5's default guidance
scale is its guider's); tokenizers and processors have none."""


@dataclass(frozen=True)
class CheckpointFacts:
    """The static facts of one checkpoint of a family (its spec applied to its configs)."""

    family: str
    """The family name (its spec's)."""
    size_multiple: int | None
    """Width and height must be multiples of this; None: no rule of the spec (the diffusers backend derives one
    from the loaded pipeline)."""
    vae_factor: int | None
    """Pixels per latent pixel; None where the spec has no geometry rule."""
    max_height: int | None
    """Largest height in pixels the DiT's position tables cover (None: no table limit known)."""
    max_width: int | None
    """Largest width in pixels the DiT's position tables cover (None: no table limit known)."""
    defaults: SamplingDefaults
    """Request defaults for this checkpoint: the spec's, refined by its `checkpoint_defaults` rule."""
    supports_continuous: bool
    """The spec's `supports_continuous`."""
    cfg_batched: bool
    """The spec's `cfg_batched`."""
    text_encoders: tuple[str, ...]
    """The spec's text encoders this checkpoint has (in encode order)."""


def describe_checkpoint(spec: FamilySpec, configs: CheckpointConfigs) -> CheckpointFacts:
    """The facts of the checkpoint whose configs are `configs`, under the family spec `spec`."""
    geometry: LatentGeometry | None = None
    defaults = spec.defaults
    try:
        geometry = spec.latent_geometry(configs) if spec.latent_geometry else None
        if spec.checkpoint_defaults is not None and geometry is not None:
            defaults = spec.checkpoint_defaults(defaults, configs, geometry)
    except (KeyError, TypeError, ValueError):
        # A folder without the configs the rules read (no VAE config ...): the spec's published figures. The
        # loader refuses such a checkpoint for the native backend, naming the missing part.
        geometry, defaults = None, spec.defaults
    limit: int | tuple[int, int] | None = None
    transformer = configs.get("transformer")
    if spec.max_latent_side is not None and transformer is not None and geometry is not None:
        limit = spec.max_latent_side(dict(transformer))
    height, width = limit if isinstance(limit, tuple) else (limit, limit)
    vae_factor = geometry.vae_factor if geometry is not None else 1  # a limit is only read with a geometry
    present = [key for key in spec.text_encoder_keys if key in configs or not configs]
    return CheckpointFacts(
        family=spec.name,
        size_multiple=geometry.size_multiple if geometry is not None else spec.size_multiple,
        vae_factor=geometry.vae_factor if geometry is not None else None,
        max_height=None if height is None else height * vae_factor,
        max_width=None if width is None else width * vae_factor,
        defaults=defaults,
        supports_continuous=spec.supports_continuous,
        cfg_batched=spec.cfg_batched,
        text_encoders=tuple(present),
    )


def square_default(defaults: SamplingDefaults, geometry: LatentGeometry, pixels: int) -> SamplingDefaults:
    """`defaults` with a square default size of `pixels`, snapped to the size multiple."""
    size = geometry.snap(pixels)
    return dataclasses.replace(defaults, width=size, height=size)


def read_checkpoint_configs(model_path: Path) -> dict[str, dict[str, Any]]:
    """A folder's configs (see `CheckpointConfigs`), from JSON only: model_index.json and each listed component's
    config file. Unreadable files are skipped: the loader's checks name them."""
    folder = Path(model_path)
    configs: dict[str, dict[str, Any]] = {}
    index = _read(folder / "model_index.json")
    if index is None:
        return configs
    configs["model_index"] = index
    for key, value in index.items():
        if key.startswith("_") or not (isinstance(value, list) and len(value) == 2 and value[1]):
            continue
        for name in _CONFIG_FILES:
            config = _read(folder / key / name)
            if config is not None:
                configs[key] = config
                break
    return configs


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None
