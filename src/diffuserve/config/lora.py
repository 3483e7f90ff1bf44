"""LoraArgs: the adapters loaded at start-up and the slots they take (the `LoRA` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag

LORA_GROUP = "LoRA"
LORA_SCALE_RANGE = (-8.0, 8.0)
"""The scales a request's `lora` entries may take (negative scales subtract a style; beyond this, images break)."""
DENOISER_PREFIX_SEP = ":"
"""`--lora-modules NAME=transformer_2:PATH` loads the adapter into the denoiser `transformer_2` (Wan2.2 A14B's
low-noise expert), as diffusers' `load_lora_weights(PATH, adapter_name=NAME, load_into_transformer_2=True)`."""
DENOISER_NAMES = ("transformer", "transformer_2")
"""The denoiser components a `--lora-modules` PATH may name before a colon (diffusers' names for them)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin")
"""The files diffusers' LoRA loader picks from an adapter folder (`_best_guess_weight_name`)."""


def adapter_path(spec: str) -> str:
    """The file or folder of a `--lora-modules` PATH (without its `transformer_2:` prefix, if any)."""
    head, sep, rest = spec.partition(DENOISER_PREFIX_SEP)
    return rest if sep and head in DENOISER_NAMES else spec


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
    max_cpu_loras: int | None = flag(
        None,
        "Adapters whose weights stay in host memory (an LRU); beyond it an adapter is re-read from disk when a "
        "batch needs it. At least --max-loras (default: --max-loras).",
        LORA_GROUP,
    )
    """Host LRU capacity; None: --max-loras."""
    enable_lora_updates: bool = flag(
        False,
        "Allow POST /v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/set_lora at runtime (paths only "
        "under --lora-root).",
        LORA_GROUP,
    )
    """Runtime adapter changes over HTTP."""
    lora_root: str | None = flag(
        None,
        "The folder runtime-loaded adapters must be under (needed by --enable-lora-updates); relative "
        "lora_path values are taken from here.",
        LORA_GROUP,
    )
    """Where runtime loads may read from."""
    registry: Any = field(default=None, repr=False, compare=False, metadata={"cli": False})
    """The process's adapter registry (`lora/registry.py` `lora_registry`), made on first use and shared by the
    HTTP handlers and the pipeline; not a flag."""

    @property
    def enabled(self) -> bool:
        """Whether the server takes adapters at all (start-up adapters, or runtime loads)."""
        return bool(self.lora_modules) or self.enable_lora_updates

    @property
    def host_capacity(self) -> int:
        """--max-cpu-loras, defaulting to --max-loras."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

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
                    self.host_capacity < self.max_loras,
                    "--max-cpu-loras",
                    f"{self.host_capacity} is below --max-loras {self.max_loras}; give at least as many",
                ),
                (
                    self.enable_lora_updates and not self.lora_root,
                    "--lora-root",
                    "--enable-lora-updates needs the folder runtime loads may read from (--lora-root DIR)",
                ),
                (
                    bool(self.lora_root) and not Path(str(self.lora_root)).is_dir(),
                    "--lora-root",
                    f"{self.lora_root!r} is not a folder; give the folder runtime-loaded adapters live under",
                ),
            ]
        )

    def check_files(self) -> None:
        """The checks that read the file system: every start-up adapter's file or folder is there (before the model
        loads, so a typo costs no load; whether the weights fit the model is checked once it is loaded)."""
        for name, spec in self.adapters.items():
            path = Path(adapter_path(spec)).expanduser()
            weights = path.is_file() or (path.is_dir() and any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()))
            what = "does not exist" if not path.exists() else "is a folder without a .safetensors file"
            check_flags(
                [
                    (
                        not weights,
                        "--lora-modules",
                        f"{name}={spec}: {str(path)!r} {what}; give an adapter folder (with "
                        "pytorch_lora_weights.safetensors) or a .safetensors file",
                    )
                ]
            )
