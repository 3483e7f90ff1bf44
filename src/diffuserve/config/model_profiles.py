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
from diffuserve.models.registry import CLASS_TO_FAMILY, VIDEO_FAMILIES

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

    def layer_bytes(self) -> int:
        """Average bytes of one declared layer (the unit a resident layer set is counted in)."""
        if self.num_layers <= 0:
            return 0
        total = self.layers_bytes or self.param_bytes
        return total // self.num_layers


@dataclass
class ModelProfile:
    """What the deployment modes know about a model family. Thresholds live here, not in the resolver."""

    family: str = "generic"
    """Family name (flux, qwen_image, wan, sana, sd3, z_image, generic)."""
    kind: str = "image"
    """image | video. Video DiT residency under `auto` follows `dit_resident_threshold_gib` only if set."""
    components: dict[str, ComponentProfile] = field(default_factory=dict)
    """Weight-holding components by model_index.json key, in pipeline order."""
    dit_resident_threshold_gib: float | None = 45.0
    """`auto` keeps the DiT resident when every selected GPU has at least this much free.
    None: `auto` never makes the DiT resident on its own (video families: frames and resolution move
    the peak too much for one figure); use `--component-residency dit=resident` with a measured recipe."""
    vae_resident_threshold_gib: float = 24.0
    """`auto` keeps VAE-like components (group vae/other) resident only with this much free per GPU."""
    large_encoder_gib: float = 2.0
    """Text/image encoders at least this large are `large auxiliary encoders`: layer-wise under `auto`
    when the DiT is resident, so the encoder's whole-component onload does not sit beside the DiT."""
    comfortable_fit_fraction: float = 0.8
    """`auto` below the DiT threshold uses component offload when the DiT takes at most this share of
    the free memory, and layer-wise offload (where supported) when it does not fit comfortably."""
    fsdp_can_replace_dit_offload: bool = False
    """Multi-GPU `auto` may shard the DiT with FSDP instead of offloading it (validated families only)."""
    default_uses_cfg: bool = False
    """The family's default sampling runs classifier-free guidance (two branches per step)."""
    compile_validated: bool = False
    """torch.compile has a validated path for this family, so `auto`/`speed`/`memory` turn it on."""
    dit_supports_layerwise: bool = False
    """The presets (`auto` below threshold, `memory`) may pick layer-wise offload for the DiT."""

    def with_components(self, components: dict[str, ComponentProfile]) -> ModelProfile:
        return dataclasses.replace(self, components=dict(components))

    def group_members(self, group: str) -> list[str]:
        return [name for name, comp in self.components.items() if comp.group == group]


_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # FLUX.1-dev is guidance-distilled: one branch per step by default. Our native adapter streams its
    # double and single blocks, so the presets may pick layer-wise for the DiT.
    "flux": {"kind": "image", "default_uses_cfg": False, "dit_supports_layerwise": True},
    # Qwen-Image runs true CFG; FSDP was not measured faster there, so auto keeps the non-FSDP path.
    "qwen_image": {"kind": "image", "default_uses_cfg": True, "dit_supports_layerwise": True},
    # Wan: FSDP can replace DiT offload on validated multi-GPU set-ups; the video VAE peaks high.
    "wan": {
        "kind": "video",
        "default_uses_cfg": True,
        "dit_resident_threshold_gib": None,
        "vae_resident_threshold_gib": 40.0,
        "fsdp_can_replace_dit_offload": True,
        "dit_supports_layerwise": True,
    },
    "sana": {"kind": "image", "default_uses_cfg": True},
    "sd3": {"kind": "image", "default_uses_cfg": True},
    # Z-Image-Turbo samples without CFG; single-GPU no-offload measured faster than FSDP/SP.
    "z_image": {"kind": "image", "default_uses_cfg": False},
    "generic": {},
}
FAMILIES = tuple(_FAMILY_DEFAULTS)

# Pipeline class name prefix -> family.
_PIPELINE_PREFIXES = (
    ("QwenImage", "qwen_image"),
    ("Flux", "flux"),
    ("Wan", "wan"),
    ("Sana", "sana"),
    ("StableDiffusion3", "sd3"),
    ("ZImage", "z_image"),
)


def family_profile(family: str) -> ModelProfile:
    """The per-family defaults (no components).

    Accepts the registry's family names too (`models/registry.py`): a variant such as `wan_i2v` or
    `qwen_image_edit` takes its base family's defaults, another registry family the generic ones (video
    kind, with no auto DiT residency, where the registry says video). Names neither knows fail with the closest known one.
    """
    base = family if family in _FAMILY_DEFAULTS else next((k for k in _FAMILY_DEFAULTS if family.startswith(k + "_")), None)
    if base is not None:
        return ModelProfile(family=family, **_FAMILY_DEFAULTS[base])
    known = sorted({*FAMILIES, *CLASS_TO_FAMILY.values(), "unknown"})
    if family not in known:
        close = difflib.get_close_matches(family, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Unknown model family {family!r}; known: {', '.join(known)}.{hint}", param="family")
    if family in VIDEO_FAMILIES:
        # Unprofiled video: no auto DiT residency, frames and resolution decide its peak (seed rule).
        return ModelProfile(family=family, kind="video", dit_resident_threshold_gib=None)
    return ModelProfile(family=family)


def family_from_pipeline_class(class_name: str) -> str:
    """The registry's family for a known pipeline class, else by class-name prefix, else generic."""
    if class_name in CLASS_TO_FAMILY:
        return CLASS_TO_FAMILY[class_name]
    for prefix, family in _PIPELINE_PREFIXES:
        if class_name.startswith(prefix):
            return family
    return "generic"


def group_of(key: str) -> str:
    """The group of a model_index.json key: the denoiser is `dit` whatever its architecture."""
    if key.startswith(("transformer", "unet")):
        return "dit"
    for group in ("text_encoder", "image_encoder", "vae"):
        if key.startswith(group):
            return group
    return "other"


# --- layer structure by model class: (container module path, how many layers it holds) ---------------
# A count is a config key, a function of the config, or None (count the indices in the safetensors
# header). Classes not listed here declare no layers: layer-wise offload is refused for them.
_Count = str | Callable[[dict[str, Any]], int] | None


def _num_blocks(cfg: dict[str, Any]) -> int:
    return len(cfg.get("block_out_channels") or [])


# Encoder paths are suffixes: transformers nests CLIP under `text_model.` in some versions and classes
# and not in others, so the loaded module is searched with `resolve_layer_containers`.
_CLIP = (("encoder.layers", "num_hidden_layers"),)
_T5 = (("encoder.block", "num_layers"),)
_DECODER_LM = (("layers", "num_hidden_layers"),)
_VAE_BLOCKS: tuple[tuple[str, _Count], ...] = (("encoder.down_blocks", None), ("decoder.up_blocks", None))
_LAYER_RULES: dict[str, tuple[tuple[str, _Count], ...]] = {
    "FluxTransformer2DModel": (("transformer_blocks", "num_layers"), ("single_transformer_blocks", "num_single_layers")),
    "QwenImageTransformer2DModel": (("transformer_blocks", "num_layers"),),
    "WanTransformer3DModel": (("blocks", "num_layers"),),
    "SanaTransformer2DModel": (("transformer_blocks", "num_layers"),),
    "SD3Transformer2DModel": (("transformer_blocks", "num_layers"),),
    "ZImageTransformer2DModel": (("layers", "n_layers"),),
    "CLIPTextModel": _CLIP,
    "CLIPTextModelWithProjection": _CLIP,
    "CLIPVisionModel": _CLIP,
    "CLIPVisionModelWithProjection": _CLIP,
    "T5EncoderModel": _T5,
    "UMT5EncoderModel": _T5,
    "Qwen2_5_VLForConditionalGeneration": (("language_model.layers", "num_hidden_layers"),),
    "Gemma2Model": _DECODER_LM,
    "Qwen3Model": _DECODER_LM,
    "AutoencoderKL": (("encoder.down_blocks", _num_blocks), ("decoder.up_blocks", _num_blocks)),
    "AutoencoderKLWan": _VAE_BLOCKS,
    "AutoencoderKLQwenImage": _VAE_BLOCKS,
    "AutoencoderDC": _VAE_BLOCKS,
}


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


def read_safetensors_sizes(path: Path, load_dtype: str | None = None) -> dict[str, int]:
    """Tensor name -> bytes, from the file's JSON header only (8-byte length, then JSON).

    With `load_dtype`, floating-point tensors are counted at that dtype (what they will occupy once
    loaded); integer tensors and `None` keep the stored size.
    """
    elem = LOAD_DTYPE_SIZES[load_dtype] if load_dtype else None
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
    sizes: dict[str, int] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        stored = int(end) - int(begin)
        size = _FLOAT_SIZES.get(entry.get("dtype", ""))
        sizes[name] = stored // size * elem if elem and size else stored
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


def component_profile(name: str, class_name: str, folder: Path, load_dtype: str | None = None) -> ComponentProfile:
    """Profile one component folder from its config.json and safetensors headers."""
    cfg_path = folder / "config.json"
    cfg = _read_json(cfg_path) if cfg_path.exists() else {}
    tensors: dict[str, int] = {}
    for path in _weight_files(folder):
        tensors.update(read_safetensors_sizes(path, load_dtype))
    paths: list[str] = []
    num_layers = 0
    layers_bytes = 0
    for path, count in _LAYER_RULES.get(class_name, ()):
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
    )


def profile_from_checkpoint(model_path: Path, *, family: str | None = None, load_dtype: str | None = None) -> ModelProfile:
    """The ModelProfile of a diffusers-format folder, from JSON and safetensors headers only.

    `family` overrides detection from model_index.json `_class_name` (unknown classes -> generic).
    `load_dtype` (float32 | bfloat16 | float16) counts floating-point weights at the dtype they are
    loaded in rather than stored in; None keeps the stored sizes.
    """
    model_path = Path(model_path)
    if load_dtype is not None and load_dtype not in LOAD_DTYPE_SIZES:
        raise ConfigError(f"--dtype {load_dtype!r} is not one of {', '.join(LOAD_DTYPE_SIZES)}.", param="dtype")
    index = _read_json(model_path / "model_index.json")
    family = family or family_from_pipeline_class(str(index.get("_class_name", "")))
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
    return family_profile(family).with_components(components)


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
