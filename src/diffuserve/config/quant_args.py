"""QuantArgs: online weight quantization per component (`--quantization`, `--quantization-ignored-layers`).

Declared once here (default, help, the commands that take them); which component gets which method is resolved
from these flags and the model's profile by `config/quantization.py` (pure, no torch), and the layers themselves
are `quant/`. The method names live here so `plan` and `--help` never import torch or torchao.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import flag

QUANT_GROUP = "Quantization"

METHODS: dict[str, str] = {
    "fp8": "FP8 e4m3 weights, per-output-channel scales; FP8 GEMM with per-token activation scales on CUDA sm89+, "
    "weight-only elsewhere",
    "int8": "int8 weights, per-output-channel scales, weight-only",
    "int8-dynamic": "int8 weights and per-token dynamically quantized int8 activations (W8A8)",
}
"""The online methods and what each does (`docs/quantization.md`)."""
NONE = "none"
"""Selector value that keeps a component (or a group's member) in the compute dtype: `all=int8 vae=none`."""


@dataclass
class QuantArgs:
    """Which components are quantized at load, with which method, and which layers never are."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate", "plan")

    quantization: list[str] = flag(
        [],
        f"Quantize weights at load: a METHOD for the denoiser, or COMPONENT=METHOD selectors as in "
        f"--component-residency (a model_index.json key, a group dit / text_encoder / image_encoder, or all). "
        f"METHOD: {', '.join(METHODS)} or {NONE} (docs/quantization.md).",
        QUANT_GROUP,
        nargs="+",
        metavar="[COMPONENT=]METHOD",
    )
    """A bare method (the denoiser) or selectors; empty: every component keeps the compute dtype."""
    quantization_ignored_layers: list[str] = flag(
        [],
        "Module-name patterns (globs over the dotted name, e.g. '*.attn.to_out.0' 'single_transformer_blocks.*') "
        "kept in the compute dtype, added to the family's own never-quantized list.",
        QUANT_GROUP,
        nargs="+",
        metavar="PATTERN",
    )
    """Extra never-quantize globs, for every quantized component."""

    @property
    def enabled(self) -> bool:
        return bool(self.quantization)

    def validate(self) -> None:
        """The method names are checked against the model's components in `config/quantization.py` (they need the
        profile); nothing here can be checked alone."""
