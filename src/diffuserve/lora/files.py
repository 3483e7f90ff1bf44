"""Reading LoRA adapter files through diffusers' own state-dict loading and conversion, and checking them
against the served transformer.

diffusers' `*LoraLoaderMixin.lora_state_dict` reads the file (a folder with `pytorch_lora_weights.safetensors`, or
the file itself) and converts the community formats it knows (kohya / Civitai, XLabs, BFL control LoRAs) into
diffusers' own keys: `transformer.<module>.lora_A.weight` / `.lora_B.weight`. We take that state dict as it is
and only check that every adapted module is a Linear of the served transformer with matching shapes.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from diffuserve.config.lora import DENOISER_NAMES, DENOISER_PREFIX_SEP
from diffuserve.errors import ConfigError


def lora_families() -> list[str]:
    """The families whose native adapter takes per-request LoRA (their spec names a diffusers loader)."""
    from diffuserve.family_spec import all_specs

    return sorted(name for name, spec in all_specs().items() if spec.lora_loader)


def lora_loader(family: str) -> str:
    """The diffusers `*LoraLoaderMixin` that reads `family`'s adapter files (its spec's `lora_loader`); refused
    (ConfigError) naming the family when it has none."""
    from diffuserve.family_spec import spec_for

    try:
        loader = spec_for(family).lora_loader
    except KeyError:
        loader = None
    if loader is None:
        raise ConfigError(
            f"--lora-modules: per-request LoRA is not available for the {family} family on the native backend "
            f"(it is for: {', '.join(lora_families())})."
        )
    return loader


def split_target(path: str, denoisers: tuple[str, ...]) -> tuple[str, str]:
    """(denoiser, path) of a `--lora-modules` PATH: `transformer_2:/adapters/x` names the denoiser the adapter
    goes into (one of `denoisers`); a plain path goes into the first (`transformer`)."""
    head, sep, rest = path.partition(DENOISER_PREFIX_SEP)
    if not sep or head not in DENOISER_NAMES:
        return denoisers[0], path
    if head not in denoisers:
        raise ConfigError(
            f"--lora-modules: {path!r} names the denoiser {head!r}, which this checkpoint does not have "
            f"(it has: {', '.join(denoisers)})."
        )
    return head, rest


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
    denoiser: str = "transformer"
    """The denoiser component it adapts (`transformer_2`: Wan2.2 A14B's low-noise expert)."""

    @property
    def rank(self) -> int:
        return max((m.down.shape[0] for m in self.modules.values()), default=0)

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of what the adapter does: the denoiser, and per module its name, scaling and the A / B
        weights' dtype, shape and bytes (not its name or path: the same weights under another name or folder give
        the same fingerprint; other weights under the same name another). Computed once, on first use (the
        registry reads it when the adapter is read, in the thread that reads it)."""
        import torch

        digest = hashlib.sha256(self.denoiser.encode())
        for module in sorted(self.modules):
            entry = self.modules[module]
            digest.update(f"\0{module}\0{entry.scaling!r}".encode())
            for weight in (entry.down, entry.up):
                tensor = weight.detach().to("cpu").contiguous()
                digest.update(f"\0{tensor.dtype}{tuple(tensor.shape)}".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        return digest.hexdigest()[:20]


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
    loader: str, path: str | Path
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(state dict in diffusers' keys, network alphas, saved LoraConfig) of the adapter at `path`, read by
    diffusers' `loader` (a `*LoraLoaderMixin` name; FLUX.1's also returns the kohya alphas, the others fold them
    into the weights when they convert)."""
    import diffusers.loaders

    source = Path(path)
    if not source.exists():
        raise ConfigError(
            f"--lora-modules: {str(path)!r} does not exist; give an adapter folder (with "
            "pytorch_lora_weights.safetensors) or a .safetensors file."
        )
    kwargs: dict[str, Any] = {"weight_name": source.name} if source.is_file() else {}
    where = str(source.parent if source.is_file() else source)
    cls = getattr(diffusers.loaders, loader)
    if "return_alphas" in inspect.signature(cls.lora_state_dict).parameters:
        state_dict, alphas, metadata = cls.lora_state_dict(
            where, return_alphas=True, return_lora_metadata=True, **kwargs
        )
        return state_dict, alphas, metadata
    state_dict, metadata = cls.lora_state_dict(where, return_lora_metadata=True, **kwargs)
    return state_dict, None, metadata


def read_adapter(
    name: str, path: str | Path, family: str, transformer: Any, *, max_rank: int, denoiser: str = "transformer"
) -> LoraAdapter:
    """Read adapter `name` from `path` for `family` and check it fits `transformer` (the denoiser component
    `denoiser`): refused (ConfigError) naming the first module that is missing, not a Linear, of another shape,
    or of a rank above `max_rank`."""
    import torch

    state_dict, alphas, saved = read_lora_state_dict(lora_loader(family), path)
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
    return LoraAdapter(name, str(path), modules, denoiser)
