"""What a `--transformer-path` file is, read from its header only (no tensor data, no torch).

Users download the denoiser of a big model as one pre-quantized file and keep the base diffusers folder for
its config, encoders and VAE (SGLang's `--transformer-path`). Three kinds are recognised by their bytes, not
their names:

- **GGUF** (the `GGUF` magic): community files for FLUX.1, FLUX.2, Qwen-Image, Wan and Z-Image, each
  weight in a llama.cpp block format (Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, ...), norms and biases in F32 / F16.
  The header gives every tensor's type and byte size, and usually the architecture.
- **Black Forest Labs' quantized safetensors** (`*.weight_scale` tensors): `fp8r` (E4M3 weights with
  per-row scales) or `nvfp4` (packed E2M1 weights, E4M3 block scales, a global `weight_scale_2` and an
  `input_scale`), the FLUX.2-dev-NVFP4 layout.
- **Plain safetensors**: a full-precision single file (the method is its dtype).

`describe_file` answers the method (`gguf:Q4_K`, `bfl:nvfp4`, ...) and the bytes the weights occupy once
loaded, which is what `plan` counts and `auto` residency decides from: quantized tensors keep their stored
size, floating-point ones (norms, biases, embedders kept in high precision) are counted at the load dtype,
as diffusers casts them. `models/quantized_files.py` loads the file.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError

FLAG = "--transformer-path"
_GGUF_MAGIC = b"GGUF"
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_LOAD_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_GGUF_FLOATS = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
BFL_SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")
_DTYPE_NAMES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64"}

GGUF_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "flux": ("flux",),
    "flux_kontext": ("flux",),
    "flux2": ("flux2", "flux"),
    "flux2_klein": ("flux2", "flux"),
    "qwen_image": ("qwen_image",),
    "qwen_image_edit": ("qwen_image",),
    "qwen_image_edit_plus": ("qwen_image",),
    "wan": ("wan",),
    "wan_i2v": ("wan",),
    "z_image": ("z_image", "lumina2"),
}
"""Family -> the `general.architecture` values GGUF files for it carry (the names ComfyUI-GGUF's converter
writes). A file naming an architecture that belongs only to other families is refused before loading."""

SINGLE_FILE_FAMILIES = tuple(GGUF_ARCHITECTURES)
"""Native families whose transformer diffusers' `from_single_file` converts (its SINGLE_FILE_LOADABLE_CLASSES)."""

_BLOCK_CONTAINERS = re.compile(
    r"^(?:model\.diffusion_model\.)?(?:double_blocks|single_blocks|transformer_blocks|single_transformer_blocks"
    r"|blocks|layers)\.\d+\."
)


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the file, as its header describes it."""

    shape: tuple[int, ...]
    """Logical shape (for a GGUF block format, the dequantized shape, in torch order)."""
    kind: str
    """GGUF type name (`Q4_K`, `F32`) or safetensors dtype (`F8_E4M3`, `U8`, `BF16`)."""
    stored_bytes: int
    """Bytes in the file."""


@dataclass(frozen=True)
class TransformerFile:
    """A `--transformer-path` file, described from its header."""

    path: Path
    format: str
    """gguf | bfl | safetensors."""
    method: str
    """What the plan, the log and /server_info show: `gguf:Q4_K`, `bfl:nvfp4`, `bfl:fp8r`, `bf16`, ..."""
    tensors: dict[str, FileTensor] = field(default_factory=dict)
    architecture: str | None = None
    """GGUF `general.architecture`, when the file says."""
    quant_types: dict[str, int] = field(default_factory=dict)
    """GGUF / BFL: quantized type -> number of tensors in it (a file mixes types, e.g. Q4_K with Q6_K)."""

    def loaded_bytes(self, load_dtype: str | None) -> int:
        """Bytes of the weights once loaded: quantized tensors and their scales as stored, other floating-point
        ones at `load_dtype`."""
        return sum(self._loaded(n, t, load_dtype) for n, t in self.tensors.items())

    def layers_bytes(self, load_dtype: str | None) -> int:
        """The part of `loaded_bytes` inside numbered blocks (what layer-wise offload streams)."""
        return sum(self._loaded(n, t, load_dtype) for n, t in self.tensors.items() if _BLOCK_CONTAINERS.match(n))

    def _loaded(self, name: str, tensor: FileTensor, load_dtype: str | None) -> int:
        size = (_GGUF_FLOATS if self.format == "gguf" else _SAFETENSORS_FLOATS).get(tensor.kind)
        keeps_dtype = self.format == "bfl" and name.endswith(BFL_SCALES)  # BFL's scales stay fp32 / fp8
        if size is None or load_dtype is None or keeps_dtype:
            return tensor.stored_bytes
        return tensor.stored_bytes // size * _LOAD_SIZES[load_dtype]


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{FLAG}: {str(path)!r} {why}", param="transformer_path")


def describe_file(path: str | Path) -> TransformerFile:
    """Read the header of a `--transformer-path` file. Raises ConfigError naming the flag and the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise _unreadable(path, "is not a file; give a .gguf or .safetensors transformer file.")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise _unreadable(path, f"cannot be read ({exc.strerror or exc}).") from exc
    if magic == _GGUF_MAGIC:
        return _describe_gguf(path)
    return _describe_safetensors(path)


def _describe_gguf(path: Path) -> TransformerFile:
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # a declared dependency; only a broken install lands here
        raise _unreadable(path, "is a GGUF file, and reading it needs the `gguf` package (pip install gguf).") from exc
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError / struct errors on a truncated file
        raise _unreadable(path, f"starts like a GGUF file but its header cannot be read ({exc}).") from exc
    tensors: dict[str, FileTensor] = {}
    for t in reader.tensors:
        # GGUF stores dimensions innermost first; torch's order is the reverse.
        tensors[t.name] = FileTensor(tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name, int(t.n_bytes))
    arch = None
    arch_field = reader.fields.get("general.architecture")
    if arch_field is not None:
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8", "replace")
    quant = collections.Counter(t.kind for t in tensors.values() if t.kind not in _GGUF_FLOATS)
    return TransformerFile(path, "gguf", _method("gguf", quant, tensors), tensors, arch, dict(quant))


def _method(prefix: str, quant: collections.Counter[str], tensors: dict[str, FileTensor]) -> str:
    """The dominant quantized type by bytes (`gguf:Q4_K`); a file with none is named by its float dtype."""
    if not quant:
        floats = collections.Counter(t.kind for t in tensors.values())
        kind = floats.most_common(1)[0][0] if floats else "F32"
        return _DTYPE_NAMES.get(kind, kind.lower())
    by_bytes: collections.Counter[str] = collections.Counter()
    for t in tensors.values():
        if t.kind in quant:
            by_bytes[t.kind] += t.stored_bytes
    return f"{prefix}:{by_bytes.most_common(1)[0][0]}"


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte length, then JSON). Raises ConfigError naming the flag."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise _unreadable(path, "is neither a GGUF nor a safetensors file (too short).")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES or length > path.stat().st_size - 8:
            raise _unreadable(path, "is neither a GGUF nor a safetensors file (no valid header).")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _unreadable(path, f"is neither a GGUF nor a safetensors file ({exc}).") from exc
    if not isinstance(header, dict):
        raise _unreadable(path, "has a safetensors header that is not a JSON object.")
    return header


def _describe_safetensors(path: Path) -> TransformerFile:
    header = read_safetensors_header(path)
    tensors: dict[str, FileTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shape = tuple(int(d) for d in entry.get("shape", ()))
        tensors[name] = FileTensor(shape, str(entry.get("dtype", "")), int(end) - int(begin))
    scaled = [n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")]
    if not scaled:
        if any(n.endswith(".scale_weight") for n in tensors):
            raise _unreadable(
                path,
                "is a ComfyUI 'scaled fp8' file (`scale_weight` tensors), which diffusers cannot load; use a GGUF "
                "file or Black Forest Labs' fp8r / NVFP4 file of the model instead.",
            )
        return TransformerFile(path, "safetensors", _method("", collections.Counter(), tensors), tensors)
    quant: collections.Counter[str] = collections.Counter()
    for prefix in scaled:
        quant["nvfp4" if f"{prefix}.weight_scale_2" in tensors else "fp8r"] += 1
    sizes = collections.Counter({k: 0 for k in quant})
    for prefix in scaled:
        kind = "nvfp4" if f"{prefix}.weight_scale_2" in tensors else "fp8r"
        sizes[kind] += tensors[f"{prefix}.weight"].stored_bytes if f"{prefix}.weight" in tensors else 0
    method = f"bfl:{sizes.most_common(1)[0][0]}"
    # The packed NVFP4 weight [N, K/2] is [N, K] to the model: keep logical shapes for the shape check.
    for prefix in scaled:
        weight = tensors.get(f"{prefix}.weight")
        if weight is not None and f"{prefix}.weight_scale_2" in tensors and len(weight.shape) == 2:
            logical = (weight.shape[0], weight.shape[1] * 2)
            tensors[f"{prefix}.weight"] = dataclasses.replace(weight, shape=logical)
    return TransformerFile(path, "bfl", method, tensors, None, dict(quant))


def check_architecture(info: TransformerFile, family: str) -> None:
    """Refuse a GGUF file whose `general.architecture` belongs to other families only."""
    if info.architecture is None or family not in GGUF_ARCHITECTURES:
        return
    ours = GGUF_ARCHITECTURES[family]
    known = {a for arches in GGUF_ARCHITECTURES.values() for a in arches}
    if info.architecture in known and info.architecture not in ours:
        raise ConfigError(
            f"{FLAG}: {str(info.path)!r} is a GGUF file for architecture {info.architecture!r}, but --model-path is "
            f"a {family} checkpoint (its GGUF files say {' or '.join(map(repr, ours))}); give the file made from "
            "this model, or the base folder of the model the file was made from.",
            param="transformer_path",
        )


def check_family(family: str) -> None:
    """Refuse families whose transformer diffusers cannot load from one file."""
    if family not in SINGLE_FILE_FAMILIES:
        raise ConfigError(
            f"{FLAG}: the {family} family's transformer cannot be loaded from a single file; families that can: "
            f"{', '.join(SINGLE_FILE_FAMILIES)}. Serve the checkpoint folder alone with --model-path.",
            param="transformer_path",
        )


def profile_component(component: Any, info: TransformerFile, load_dtype: str | None) -> Any:
    """The base folder's transformer ComponentProfile, counted at the file's bytes and named by its method."""
    return dataclasses.replace(
        component,
        param_bytes=info.loaded_bytes(load_dtype),
        layers_bytes=info.layers_bytes(load_dtype) if component.has_layers else 0,
        prequantized=info.method,
    )


def with_transformer_file(profile: Any, transformer_path: str | Path, load_dtype: str | None) -> Any:
    """`profile` (a ModelProfile of the base folder) with its transformer counted from the file's header, after the
    checks that need no weights: a family diffusers loads single files of, and a GGUF file of its architecture."""
    check_family(profile.family)
    info = describe_file(transformer_path)
    check_architecture(info, profile.family)
    if "transformer" not in profile.components:
        raise ConfigError(
            f"{FLAG}: the checkpoint at --model-path has no transformer component.", param="transformer_path"
        )
    components = dict(profile.components)
    components["transformer"] = profile_component(components["transformer"], info, load_dtype)
    return profile.with_components(components)


def check_parallel(plan: Any, method: str) -> None:
    """Refuse the parallel modes that shard weights (TP, FSDP): a file's packed blocks are not plain tensors."""
    flags = [f for f, on in (("--tp-size", plan.tp_size > 1), ("--use-fsdp-inference", plan.use_fsdp_inference)) if on]
    if flags:
        raise ConfigError(
            f"{FLAG} ({method}) with {' and '.join(flags)}: a pre-quantized transformer file cannot be sharded (its "
            "packed weights are not plain tensors). Drop the flag (pass --use-fsdp-inference false where the "
            "performance mode chose FSDP); CFG parallel, Ulysses / Ring sequence parallel and replicas (--dp-size) "
            "keep whole weights on each GPU and do work.",
            param="transformer_path",
        )
