"""The `--controlnet [NAME=]PATH ...` flag: parsing and the checks that need no model (names, folders).

Each ControlNet is a component of the deployment plan beside the base model, keyed as diffusers keys repeated
components: `controlnet`, `controlnet_2`, `controlnet_3`, ... in flag order (`component_key`). Requests select one
by its NAME (`controlnet` request field), which defaults to the folder's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from diffuserve.config.argparse_dataclass import flag
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


CONTROLNET_GROUP = "ControlNet"
_GEN = ("generate",)


@dataclass
class ControlNetArgs:
    """ControlNets loaded beside the base model, and `generate`'s control inputs (docs/api.md "ControlNet")."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate", "plan")

    controlnet: list[str] = flag(
        [],
        "ControlNet checkpoints to load beside the base model, PATH or NAME=PATH each (diffusers ControlNet "
        "folders: FluxControlNetModel incl. Union, SD3ControlNetModel, QwenImageControlNetModel). NAME defaults to "
        "the folder's name; requests pick one with `controlnet` when several are loaded. Each is a plan component "
        "(controlnet, controlnet_2, ...).",
        CONTROLNET_GROUP,
        nargs="+",
        metavar="[NAME=]PATH",
        per_command={"plan": {"help": "ControlNet folders, planned as components beside the base.", "group": None}},
    )
    """[NAME=]PATH per ControlNet (`models/controlnets.py`)."""
    control_image: str | None = flag(
        None,
        "Control image (PNG, JPEG or WebP; resized to the output size) for --controlnet.",
        CONTROLNET_GROUP,
        commands=_GEN,
    )
    """The control image file of every prompt's request."""
    control_mode: int | None = flag(
        None, "Union ControlNets: the control type index (required there).", CONTROLNET_GROUP, commands=_GEN
    )
    """As the request field `control_mode`."""
    controlnet_conditioning_scale: float | None = flag(
        None, "Weight of the ControlNet's residuals (default: 1.0).", CONTROLNET_GROUP, commands=_GEN
    )
    """As the request field."""
    control_guidance_start: float | None = flag(
        None, "Share of the steps before the ControlNet applies (default: 0).", CONTROLNET_GROUP, commands=_GEN
    )
    """As the request field."""
    control_guidance_end: float | None = flag(
        None, "Share of the steps after which it stops (default: 1).", CONTROLNET_GROUP, commands=_GEN
    )
    """As the request field."""
    controlnet_name: str | None = flag(
        None, "Which loaded ControlNet (its NAME) when several are loaded.", CONTROLNET_GROUP, commands=_GEN
    )
    """The request field `controlnet`."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag: the entries' form and names."""
        parse_controlnets(self.controlnet)
        given = [n for n in _COMPANIONS if getattr(self, n) is not None]
        if given and self.control_image is None:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --control-image.", param=given[0])
        if self.control_image is not None and not self.controlnet:
            raise ConfigError(
                "--control-image needs a ControlNet: add --controlnet [NAME=]PATH.", param="control_image"
            )

    def check_files(self) -> None:
        """The folders exist with a config.json; the control image is readable."""
        check_controlnet_flag(self.controlnet)
        if self.control_image is not None and not Path(self.control_image).expanduser().is_file():
            raise ConfigError(f"--control-image: {self.control_image!r} is not a file.", param="control_image")


_COMPANIONS = (
    "control_mode",
    "controlnet_conditioning_scale",
    "control_guidance_start",
    "control_guidance_end",
    "controlnet_name",
)
