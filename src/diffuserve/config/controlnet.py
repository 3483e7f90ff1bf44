"""The `--controlnet [NAME=]PATH ...` flag: parsing and the checks that need no model (names, folders).

Each ControlNet is a component of the deployment plan beside the base model, keyed as diffusers keys repeated
components: `controlnet`, `controlnet_2`, `controlnet_3`, ... in flag order (`component_key`). Requests select one
by its NAME (`controlnet` request field), which defaults to the folder's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from diffuserve.errors import ConfigError

FLAG = "--controlnet"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class ControlNetEntry:
    """One `--controlnet` entry."""

    name: str
    """The name requests select it by (`controlnet` request field)."""
    path: Path
    """The diffusers ControlNet folder (config.json + safetensors)."""
    key: str
    """Its component key in the plan and the residency manager: `controlnet`, `controlnet_2`, ..."""


def component_key(index: int) -> str:
    """The component key of the `index`-th (0-based) ControlNet, as diffusers names repeated components."""
    return "controlnet" if index == 0 else f"controlnet_{index + 1}"


def parse_controlnets(entries: list[str] | None) -> list[ControlNetEntry]:
    """`[NAME=]PATH` strings -> entries (NAME defaults to the folder's name). Raises ConfigError naming the flag."""
    parsed: list[ControlNetEntry] = []
    for index, entry in enumerate(entries or []):
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = Path(entry.rstrip("/")).name, entry
        if not path or not _NAME.match(name):
            raise ConfigError(
                f"{FLAG}: {entry!r} is not [NAME=]PATH with NAME made of letters, digits, '_', '-', '.' (e.g. "
                f"{FLAG} canny=/ckpt/FLUX.1-dev-Controlnet-Canny).",
                param="controlnet",
            )
        parsed.append(ControlNetEntry(name=name, path=Path(path).expanduser(), key=component_key(index)))
    names = [e.name for e in parsed]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(
            f"{FLAG}: the name {dup!r} is given twice; name them apart with NAME=PATH (e.g. canny=... depth=...).",
            param="controlnet",
        )
    return parsed


def check_controlnet_flag(entries: list[str]) -> None:
    """Start-up check of the flag's values and folders (before any weight loads)."""
    for entry in parse_controlnets(entries):
        if not (entry.path / "config.json").is_file():
            what = "does not exist" if not entry.path.exists() else "has no config.json"
            raise ConfigError(
                f"{FLAG}: {str(entry.path)!r} {what}; give a diffusers ControlNet folder (config.json and "
                "diffusion_pytorch_model.safetensors), e.g. one saved with FluxControlNetModel.save_pretrained.",
                param="controlnet",
            )
