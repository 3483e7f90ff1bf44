"""LoraArgs: the adapters loaded at start-up and the slots they take (the `LoRA` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag

LORA_GROUP = "LoRA"
LORA_SCALE_RANGE = (-8.0, 8.0)
"""The scales a request's `lora` entries may take (negative scales subtract a style; beyond this, images break)."""


@dataclass
class LoraArgs:
    """Per-request LoRA adapters (docs/lora.md)."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve",)

    lora_modules: list[str] = flag(
        [],
        "LoRA adapters to load at start-up, NAME=PATH each (PATH: a folder with pytorch_lora_weights.safetensors "
        "or a .safetensors file; diffusers' and the community formats diffusers converts). Requests select them "
        "with `lora` or `model: NAME`.",
        LORA_GROUP,
        nargs="+",
        metavar="NAME=PATH",
    )
    """NAME=PATH per adapter."""
    max_loras: int = flag(4, "Adapter slots on the device at once (every adapted layer holds this many).", LORA_GROUP)
    """Slots per adapted layer."""
    max_lora_rank: int = flag(
        16, "Largest adapter rank accepted; slots are this rank (smaller ranks are padded).", LORA_GROUP
    )
    """Rank of every slot."""

    @property
    def adapters(self) -> dict[str, str]:
        """Adapter name -> path, in flag order."""
        return dict(entry.split("=", 1) for entry in self.lora_modules)

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            check_flags(
                [
                    (
                        not sep or not name or not path,
                        "--lora-modules",
                        f"{entry!r} is not NAME=PATH (e.g. --lora-modules style=/adapters/style)",
                    )
                ]
            )
        names = [e.partition("=")[0] for e in self.lora_modules]
        dup = next((n for n in names if names.count(n) > 1), None)
        check_flags(
            [
                (dup is not None, "--lora-modules", f"the name {dup!r} is given twice; names must be unique"),
                (self.max_loras < 1, "--max-loras", f"{self.max_loras} must be >= 1"),
                (self.max_lora_rank < 1, "--max-lora-rank", f"{self.max_lora_rank} must be >= 1"),
                (
                    len(names) > self.max_loras,
                    "--max-loras",
                    f"{len(names)} adapters in --lora-modules but {self.max_loras} slots; raise --max-loras",
                ),
            ]
        )
