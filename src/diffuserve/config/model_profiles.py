"""Per-family facts the deployment resolver needs: components, their sizes and layers, thresholds.

`profile_from_checkpoint` reads only JSON (model_index.json, each component's config.json) and the
JSON headers of the `*.safetensors` files, never a tensor, so `diffuserve plan` explains a deployment
of a 60 GB checkpoint in milliseconds and without torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuserve.errors import CheckpointError, ConfigError
from diffuserve.family_spec.base import ProfileFacts
from diffuserve.family_spec.checkpoint import CheckpointFacts, describe_checkpoint, read_checkpoint_configs

GROUPS = ("dit", "text_encoder", "image_encoder", "vae", "other")
"""Component groups, usable as `--component-residency` selectors (with `all`)."""

# A safetensors header larger than this is a corrupt file, not a real index of tensors.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# model_index.json keys that hold no weights.
_NON_COMPONENT_PREFIXES = ("tokenizer", "scheduler", "feature_extractor", "image_processor", "processor")


@dataclass
class ComponentProfile:
    """One weight-holding component of a pipeline (a model_index.json key)."""

    name: str = ""
    """The model_index.json key (`transformer`, `text_encoder_2`, `vae`, ...)."""
    group: str = "other"
    """dit | text_encoder | image_encoder | vae | other."""
    class_name: str = ""
    """Model class from model_index.json (e.g. FluxTransformer2DModel)."""
    param_bytes: int = 0
    """Bytes of all weights as stored (sum of the safetensors tensors)."""
    layer_container_paths: tuple[str, ...] = ()
    """ModuleLists whose children are the streamable layers, in execution order. Each is a module path
    or a suffix of one (`encoder.layers`); `resolve_layer_containers` finds the full path in the loaded
    module, because library versions nest the same encoder differently."""
    num_layers: int = 0
    """Total streamable layers over all containers."""
    layers_bytes: int = 0
    """Bytes inside the declared layers (0: unknown, estimated from param_bytes)."""
    has_layers: bool = False
    """True when the component declares a layer structure, so layer-wise offload can run on it."""
    unquantized_bytes: int = 0
    """A quantized component (`--quantization`): its bytes at the load dtype, before quantization (`param_bytes`
    is then its quantized size); 0 for a component that is not quantized."""
    prequantized: str = ""
    """How its weights are stored when pre-quantized: `gguf:Q4_K`, `bfl:nvfp4` (a `--transformer-path` file),
    `torchao` (a folder whose config.json carries a quantization_config); empty for full precision."""

    def layer_bytes(self) -> int:
        """Average bytes of one declared layer (the unit a resident layer set is counted in)."""
        if self.num_layers <= 0:
            return 0
        total = self.layers_bytes or self.param_bytes
        return total // self.num_layers


@dataclass(frozen=True)
class ModelProfile(ProfileFacts):
    """What the deployment modes know about one checkpoint: its family's plan facts (`ProfileFacts`, from the
    family spec; thresholds live there, not in the resolver) and its weight-holding components."""

    family: str = "generic"
    """Family name (a spec name from `diffuserve.family_spec`, or generic)."""
    kind: str = "image"
    """image | video. Video DiT residency under `auto` follows `dit_resident_threshold_gib` only if set."""
    components: dict[str, ComponentProfile] = field(default_factory=dict)
    """Weight-holding components by model_index.json key, in pipeline order."""
    dit_attention_heads: int | None = None
    """Attention heads of the DiT (`transformer/config.json` `num_attention_heads`); sequence and tensor
    parallel degrees must divide it. None when the config does not say."""
    backend: str = "native"
    """native | diffusers: the backend that will serve it (`family_spec.backend_for` under `--backend`). The diffusers
    backend's denoising loop cannot be split over ranks, so the plan refuses CFG parallel / SP / TP / FSDP for it."""
    cfg_batched: bool = False
    """The family spec's `cfg_batched` (CFG as one doubled batch: no CFG parallel)."""
    supports_continuous: bool = False
    """The family spec's `supports_continuous` on the native backend (`--batching-mode continuous` steps it)."""
    checkpoint: CheckpointFacts | None = None
    """The checkpoint's facts from its configs (`family_spec.checkpoint.describe_checkpoint`, as the native adapter
    derives them at load); None for a profile built without a folder."""

    def with_components(self, components: dict[str, ComponentProfile]) -> ModelProfile:
        return dataclasses.replace(self, components=dict(components))

    def group_members(self, group: str) -> list[str]:
        return [name for name, comp in self.components.items() if comp.group == group]


def family_profile(family: str, backend: str = "auto") -> ModelProfile:
    """The family's plan facts (no components), from its spec in `diffuserve.family_spec`, served by the backend
    `--backend` picks (`auto`: native when the family has an adapter).

    `generic`/`unknown` give the generic defaults. Names no spec knows fail with the closest known one.
    """
    from diffuserve import family_spec

    known = sorted({*family_spec.all_specs(), "generic", "unknown"})
    if family not in known:
        close = difflib.get_close_matches(family, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Unknown model family {family!r}; known: {', '.join(known)}.{hint}", param="family")
    spec = family_spec.spec_for(family)
    served_by = family_spec.backend_for(family, backend)
    return ModelProfile(
        family="generic" if family == "unknown" else family,
        kind=spec.output_kind,
        backend=served_by,
        cfg_batched=spec.cfg_batched,
        supports_continuous=spec.supports_continuous and served_by == "native",
        **dataclasses.asdict(spec.profile),
    )


def group_of(key: str) -> str:
    """The group of a model_index.json key: the denoiser is `dit` whatever its architecture."""
    if key.startswith(("transformer", "unet")):
        return "dit"
    for group in ("text_encoder", "image_encoder", "vae"):
        if key.startswith(group):
            return group
    return "other"


# --- layer structure: the one table is `diffuserve.family_spec.layer_rules()` (shared encoder/VAE classes plus
# each family's own DiT classes). Classes not listed there declare no layers: layer-wise offload is refused.
_Count = str | Callable[[dict[str, Any]], int] | None


def _config_count(cfg: dict[str, Any], count: _Count) -> int | None:
    if count is None:
        return None
    if callable(count):
        return count(cfg)
    # transformers keeps some sizes under text_config (multimodal models).
    for source in (cfg, cfg.get("text_config") or {}):
        if isinstance(source.get(count), int):
            return int(source[count])
    return None


def _layer_pattern(path: str) -> re.Pattern[str]:
    return re.compile(r"(?:^|\.)" + re.escape(path) + r"\.(\d+)\.")


def _scan_layers(path: str, tensors: dict[str, int]) -> tuple[set[int], int]:
    """(layer indices, bytes) of header keys under `path.N.`; falls back to the last path segment,
    because checkpoints saved by older library versions name some containers differently."""
    for candidate in (path, path.rsplit(".", 1)[-1]):
        pattern = _layer_pattern(candidate)
        indices: set[int] = set()
        size = 0
        for key, nbytes in tensors.items():
            match = pattern.search(key)
            if match:
                indices.add(int(match.group(1)))
                size += nbytes
        if indices:
            return indices, size
    return set(), 0


# --- safetensors headers -------------------------------------------------------------------------------
_FLOAT_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
LOAD_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the `--dtype` values floating-point weights are cast to at load."""


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> its header entry (`dtype`, `shape`, `data_offsets`), from the file's JSON header only
    (8-byte length, then JSON)."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file (no 8-byte header length).")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER_BYTES or header_len > path.stat().st_size - 8:
            raise CheckpointError(f"{path}: safetensors header length {header_len} is invalid; the file is corrupt.")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc}).") from exc
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


Resize = Callable[[str, list[int], int], int]
"""(tensor name, shape, bytes at the load dtype) -> bytes once loaded (a quantized component's tensors)."""


def read_safetensors_sizes(path: Path, load_dtype: str | None = None, resize: Resize | None = None) -> dict[str, int]:
    """Tensor name -> bytes, from the file's JSON header only.

    With `load_dtype`, floating-point tensors are counted at that dtype (what they will occupy once
    loaded); integer tensors and `None` keep the stored size. `resize` then maps each tensor to its size once
    quantized (`config/quantization.py`).
    """
    elem = LOAD_DTYPE_SIZES[load_dtype] if load_dtype else None
    sizes: dict[str, int] = {}
    for name, entry in read_safetensors_header(path).items():
        begin, end = entry["data_offsets"]
        stored = int(end) - int(begin)
        size = _FLOAT_SIZES.get(entry.get("dtype", ""))
        sizes[name] = stored // size * elem if elem and size else stored
        if resize is not None:
            sizes[name] = resize(name, list(entry.get("shape", [])), sizes[name])
    return sizes


def _weight_files(folder: Path) -> list[Path]:
    """One weight set of a component folder: the plain files, else the first variant (e.g. `fp16`).

    Folders often hold `model.safetensors` next to `model.fp16.safetensors`; adding both would double
    the size, so files are grouped by variant and one group is taken.
    """
    by_variant: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        stem = re.sub(r"-\d+-of-\d+$", "", path.name[: -len(".safetensors")])
        variant = stem.split(".", 1)[1] if "." in stem else ""
        by_variant.setdefault(variant, []).append(path)
    if not by_variant:
        return []
    return by_variant.get("") or by_variant[sorted(by_variant)[0]]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing; a diffusers-format checkpoint needs it.") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}.") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object.")
    return data


def component_profile(
    name: str, class_name: str, folder: Path, load_dtype: str | None = None, *, resize: Resize | None = None
) -> ComponentProfile:
    """Profile one component folder from its config.json and safetensors headers (`resize`: each tensor's size
    once quantized)."""
    cfg_path = folder / "config.json"
    cfg = _read_json(cfg_path) if cfg_path.exists() else {}
    tensors: dict[str, int] = {}
    for path in _weight_files(folder):
        tensors.update(read_safetensors_sizes(path, load_dtype, resize))
    quantization = cfg.get("quantization_config")
    method = str(quantization.get("quant_method", "?")) if isinstance(quantization, dict) else ""
    if method and not tensors:
        # Quantized folders are often saved as pickles (torchao's tensor subclasses): their size on disk is the
        # quantized size.
        tensors = {p.name: p.stat().st_size for p in folder.glob("*.bin")}
    paths: list[str] = []
    num_layers = 0
    layers_bytes = 0
    from diffuserve import family_spec

    for path, count in family_spec.layer_rules().get(class_name, ()):
        indices, size = _scan_layers(path, tensors)
        n = _config_count(cfg, count)
        n = len(indices) if n is None else n
        if n > 0:
            paths.append(path)
            num_layers += n
            layers_bytes += size
    return ComponentProfile(
        name=name,
        group=group_of(name),
        class_name=class_name,
        param_bytes=sum(tensors.values()),
        layer_container_paths=tuple(paths),
        num_layers=num_layers,
        layers_bytes=layers_bytes,
        has_layers=num_layers > 0,
        prequantized=method,
    )


def profile_from_checkpoint(
    model_path: Path,
    *,
    family: str | None = None,
    model_id: str | None = None,
    load_dtype: str | None = None,
    backend: str = "auto",
) -> ModelProfile:
    """The ModelProfile of a diffusers-format folder, from JSON and safetensors headers only.

    `family` overrides detection; otherwise `family_spec.family_for(_class_name, model_id)` decides (the one
    precedence rule: a class some spec lists wins over the `--model-id` hint).
    `load_dtype` (float32 | bfloat16 | float16) counts floating-point weights at the dtype they are
    loaded in rather than stored in; None keeps the stored sizes. `backend` is `--backend` (auto | native |
    diffusers): the plan refuses what the backend that will serve the checkpoint cannot run, as start-up does.
    """
    model_path = Path(model_path)
    if load_dtype is not None and load_dtype not in LOAD_DTYPE_SIZES:
        raise ConfigError(f"--dtype {load_dtype!r} is not one of {', '.join(LOAD_DTYPE_SIZES)}.", param="dtype")
    from diffuserve import family_spec
    from diffuserve.family_spec import hunyuan3d_layout

    if not (model_path / "model_index.json").is_file() and hunyuan3d_layout.looks_like_hunyuan3d(model_path):
        return _hunyuan3d_profile(hunyuan3d_layout.find_subfolder(model_path, model_id))
    index = _read_json(model_path / "model_index.json")

    family = family or family_spec.family_for(str(index.get("_class_name", "")), model_id)
    components: dict[str, ComponentProfile] = {}
    for key, value in index.items():
        if key.startswith("_") or key.startswith(_NON_COMPONENT_PREFIXES):
            continue
        if not (isinstance(value, list) and len(value) == 2 and value[1]):
            continue  # [null, null]: an optional component this checkpoint leaves out
        folder = model_path / key
        if not folder.is_dir():
            raise CheckpointError(
                f"{model_path / 'model_index.json'} lists component {key!r} but folder {folder} is missing."
            )
        components[key] = component_profile(key, str(value[1]), folder, load_dtype)
    heads = _dit_attention_heads(model_path)
    profile = family_profile(family, backend).with_components(components)
    facts = describe_checkpoint(family_spec.spec_for(family), read_checkpoint_configs(model_path))
    return dataclasses.replace(profile, dit_attention_heads=heads, checkpoint=facts)


def _hunyuan3d_profile(folder: Path) -> ModelProfile:
    """Tencent's Hunyuan3D-2 layout: the three weight prefixes of model.fp16.safetensors as components."""
    from diffuserve.family_spec.hunyuan3d_layout import COMPONENTS, component_bytes

    sizes = component_bytes(folder)
    components = {
        key: ComponentProfile(name=key, group=group, class_name=cls, param_bytes=sizes[key])
        for key, (group, cls) in COMPONENTS.items()
    }
    # The DiT's declared blocks (its layer rule), counted from the `model.` keys of the one weights file.
    from diffuserve import family_spec

    weights = folder / "model.fp16.safetensors"
    stored = read_safetensors_sizes(weights) if weights.is_file() else {}
    dit = {k.split(".", 1)[1]: n for k, n in stored.items() if k.startswith("model.")}
    paths: list[str] = []
    count, nbytes = 0, 0
    for path, _ in family_spec.layer_rules().get(COMPONENTS["model"][1], ()):
        indices, size = _scan_layers(path, dit)
        if indices:
            paths.append(path)
            count, nbytes = count + len(indices), nbytes + size
    components["model"] = dataclasses.replace(
        components["model"],
        layer_container_paths=tuple(paths),
        num_layers=count,
        layers_bytes=nbytes,
        has_layers=count > 0,
    )
    return family_profile("hunyuan3d").with_components(components)


def _dit_attention_heads(model_path: Path) -> int | None:
    config = model_path / "transformer" / "config.json"
    if not config.is_file():
        return None
    heads = _read_json(config).get("num_attention_heads")
    return int(heads) if isinstance(heads, int) else None


def resolve_layer_containers(module: Any, component: ComponentProfile) -> list[str]:
    """Full module paths in `module` (a loaded torch module) of the component's declared containers.

    A declared path matches a submodule named exactly so, else the one submodule whose name ends with
    `.<path>`. Duck-typed on `named_modules()`, so this file still never imports torch.
    """
    names = [name for name, _ in module.named_modules()]
    found = []
    for path in component.layer_container_paths:
        matches = [n for n in names if n == path] or [n for n in names if n.endswith("." + path)]
        if len(matches) != 1:
            what = f"several ({', '.join(matches)})" if matches else "none"
            raise CheckpointError(
                f"{component.name} ({component.class_name}): declared layer container {path!r} matches {what} of "
                "the loaded module's submodules; the model_profiles layer rule for this class needs updating."
            )
        found.append(matches[0])
    return found
