"""Reading LoRA adapter files through diffusers' own state-dict loading and conversion, and checking them
against the served transformer.

diffusers' `*LoraLoaderMixin.lora_state_dict` reads the file (a folder with `pytorch_lora_weights.safetensors`, or
the file itself) and converts the community formats it knows (kohya / Civitai, XLabs, BFL control LoRAs) into
diffusers' own keys: `transformer.<module>.lora_A.weight` / `.lora_B.weight`. We take that state dict as it is
and only check that every adapted module is a Linear of the served transformer with matching shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError

LORA_LOADERS: dict[str, str] = {"flux": "FluxPipeline"}
"""Family -> the diffusers pipeline class whose `lora_state_dict` reads (and converts) its adapter files.

Only FLUX.1 has per-row adapted layers so far; other families are refused at start-up naming this table."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted Linear layer of an adapter."""

    down: Any
    """lora_A weight, (rank, in_features)."""
    up: Any
    """lora_B weight, (out_features, rank)."""
    scaling: float
    """lora_alpha / rank: the factor peft applies to B(A x) before the adapter weight."""


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter read from disk, checked against the served transformer."""

    name: str
    """The name requests select it by (`--lora-modules NAME=PATH`)."""
    path: str
    """Where it was read from."""
    modules: dict[str, LoraModule]
    """Transformer module name (e.g. `transformer_blocks.0.attn.to_q`) -> its A, B and scaling."""

    @property
    def rank(self) -> int:
        return max((m.down.shape[0] for m in self.modules.values()), default=0)


def _alpha(module: str, rank: int, alphas: dict[str, Any] | None, metadata: dict[str, Any] | None) -> float:
    """lora_alpha of `module` as diffusers' peft config would have it: the file's alphas, its saved LoraConfig,
    else the rank (scaling 1)."""
    for key in (f"transformer.{module}.alpha", f"{module}.alpha"):
        if alphas and key in alphas:
            return float(alphas[key])
    if metadata:
        for pattern, value in (metadata.get("alpha_pattern") or {}).items():
            if module == pattern or module.endswith("." + pattern):
                return float(value)
        if metadata.get("lora_alpha") is not None:
            return float(metadata["lora_alpha"])
    return float(rank)


def read_lora_state_dict(
    family: str, path: str | Path
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(state dict in diffusers' keys, network alphas, saved LoraConfig) of the adapter at `path`."""
    import diffusers

    loader = LORA_LOADERS.get(family)
    if loader is None:
        raise ConfigError(
            f"--lora-modules: per-request LoRA is not available for the {family} family yet "
            f"(it is for: {', '.join(sorted(LORA_LOADERS))})."
        )
    source = Path(path)
    if not source.exists():
        raise ConfigError(
            f"--lora-modules: {str(path)!r} does not exist; give an adapter folder (with "
            "pytorch_lora_weights.safetensors) or a .safetensors file."
        )
    kwargs: dict[str, Any] = {"weight_name": source.name} if source.is_file() else {}
    where = str(source.parent if source.is_file() else source)
    cls = getattr(diffusers, loader)
    state_dict, alphas, metadata = cls.lora_state_dict(where, return_alphas=True, return_lora_metadata=True, **kwargs)
    return state_dict, alphas, metadata


def read_adapter(name: str, path: str | Path, family: str, transformer: Any, *, max_rank: int) -> LoraAdapter:
    """Read adapter `name` from `path` and check it fits `transformer`: refused (ConfigError) naming the first
    module that is missing, not a Linear, of another shape, or of a rank above `max_rank`."""
    import torch

    state_dict, alphas, saved = read_lora_state_dict(family, path)
    # The saved LoraConfig of the transformer, under `transformer.`-prefixed keys (diffusers' metadata layout).
    metadata = {k[len("transformer.") :]: v for k, v in (saved or {}).items() if k.startswith("transformer.")}
    if metadata.get("use_dora"):
        raise ConfigError(f"--lora-modules {name}: DoRA adapters are not supported (only plain LoRA).")
    where = f"--lora-modules {name}={path}"
    downs: dict[str, Any] = {}
    ups: dict[str, Any] = {}
    for key, tensor in state_dict.items():
        if not key.startswith("transformer."):
            raise ConfigError(
                f"{where}: {key!r} adapts a part other than the transformer (text-encoder "
                "adapters are not supported); keep only transformer.* weights."
            )
        module, _, kind = key[len("transformer.") :].rpartition(".lora_")
        if kind == "A.weight":
            downs[module] = tensor
        elif kind == "B.weight":
            ups[module] = tensor
        elif not key.endswith(".alpha"):
            raise ConfigError(
                f"{where}: {key!r} is not a LoRA weight this server applies (lora_A / lora_B of a "
                "Linear layer); biases, DoRA magnitudes and full weights are not supported."
            )
    if not downs:
        raise ConfigError(f"{where}: the file holds no transformer LoRA weights.")
    layers = dict(transformer.named_modules())
    modules: dict[str, LoraModule] = {}
    for module in sorted(downs):
        down, up = downs[module], ups.get(module)
        layer = layers.get(module)
        if up is None:
            raise ConfigError(f"{where}: module {module!r} has lora_A but no lora_B.")
        if not isinstance(layer, torch.nn.Linear):
            what = "does not exist in" if layer is None else f"is a {type(layer).__name__}, not a Linear, in"
            raise ConfigError(
                f"{where}: module {module!r} {what} the served transformer; the adapter was made for another model."
            )
        rank = down.shape[0]
        if tuple(down.shape) != (rank, layer.in_features) or tuple(up.shape) != (layer.out_features, rank):
            raise ConfigError(
                f"{where}: module {module!r} has A {tuple(down.shape)} / B {tuple(up.shape)}, which "
                f"do not fit its Linear({layer.in_features} -> {layer.out_features}); the adapter "
                "was made for another model."
            )
        if rank > max_rank:
            raise ConfigError(
                f"{where}: module {module!r} has rank {rank} > --max-lora-rank {max_rank}; raise --max-lora-rank."
            )
        alpha = _alpha(module, rank, alphas, metadata)
        modules[module] = LoraModule(down, up, alpha / (rank**0.5 if metadata.get("use_rslora") else rank))
    return LoraAdapter(name, str(path), modules)
