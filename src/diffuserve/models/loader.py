"""Load a diffusers-format checkpoint folder into a diffuserve Pipeline.

The folder is checked part by part before anything heavy is loaded, so a broken checkpoint fails at
start-up with the folder and the missing or invalid part named, instead of deep inside diffusers or,
worse, "loading" fine: transformers 5 builds a near-empty tokenizer from a missing tokenizer folder,
so tokenizers are also checked against their text encoder's vocabulary after loading.

Where the weights go is the caller's choice (`placement`), because the residency and parallel layers own
placement: `device` (every model component moved to the device at load, for callers with no residency
manager), `host` (weights stay in host memory; `runtime/residency.py`'s `build_residency` moves resident
components to the device and leaves offloaded ones on the host, so nothing offloaded ever reaches the device
whole), or `meta` (no storage and no file read; FSDP / TP shard the meta parameters and
`models/materialize.py` reads only this rank's slices). A model that fits only when offloaded or sharded
still loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from diffuserve.errors import CheckpointError, ConfigError
from diffuserve.models import processor_substitutes, registry

if TYPE_CHECKING:
    import torch

    from diffuserve.pipelines.base import Pipeline

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")

Placement = Literal["device", "host", "meta"]
PLACEMENTS: tuple[Placement, ...] = ("device", "host", "meta")
"""Where `load_pipeline` puts a model component's weights (see the module docstring)."""

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.ckpt")
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
    "vocab.txt",
    "sentencepiece.bpe.model",
)
VOCABULARY_FREE_TOKENIZERS = frozenset({"ByT5Tokenizer"})
"""Tokenizer classes that need no vocabulary file (ByT5 maps UTF-8 bytes to ids: its folder holds only
tokenizer_config.json, which is complete; HunyuanVideo 1.5 and GLM-Image use it for glyph text)."""
MIN_VOCAB_RATIO = 0.5
"""A tokenizer with fewer entries than this share of its text encoder's vocab_size is broken."""


def parse_dtype(dtype: str) -> torch.dtype:
    """`--dtype` string -> torch dtype."""
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {list(DTYPES)}.", param="dtype")
    return getattr(torch, dtype)


def parse_device(device: str) -> torch.device:
    """`--device` string -> torch device, refusing one this machine does not have."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1).", param="device"
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: CUDA is not available on this machine; use --device cpu.", param="device"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible.", param="device"
        )
    return dev


# -- checks before loading ---------------------------------------------------------------------------


def _component_class(model_path: Path, key: str, library: str, class_name: str) -> type:
    # diffusers also names pipeline-local modules, e.g. ["ltx2", "LTX2TextConnectors"]. Those win, as in
    # diffusers: a top-level import of "ltx2" would find any folder of that name on sys.path (a checkpoint
    # folder in the working directory under `python -m`) and report the class missing.
    if library not in ("diffusers", "transformers"):
        with contextlib.suppress(ImportError):
            return _class_in(
                importlib.import_module(f"diffusers.pipelines.{library}"), model_path, key, library, class_name
            )
    try:
        module = importlib.import_module(library)
    except ImportError as exc:
        raise CheckpointError(
            f"checkpoint {model_path}: component {key!r} needs library {library!r}, which is not installed ({exc})."
        ) from exc
    return _class_in(module, model_path, key, library, class_name)


def _class_in(module: Any, model_path: Path, key: str, library: str, class_name: str) -> type:
    cls = getattr(module, class_name, None)
    if cls is None:
        raise CheckpointError(
            f"checkpoint {model_path}: component {key!r} names class {library}.{class_name}, which this "
            f"{library} does not have; fix model_index.json or upgrade {library}."
        )
    return cls


def _check_config_json(folder: Path, name: str, key: str) -> None:
    path = folder / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder.parent}: component folder {folder} has no {name}.")
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {folder.parent}: {path} is not valid JSON ({exc}).") from exc


def check_checkpoint(
    model_path: Path, spec: registry.ModelSpec, *, replaced: frozenset[str] = frozenset()
) -> dict[str, type]:
    """Check every component's folder, config and weights; returns key -> class. Raises CheckpointError.
    `replaced`: components whose weights come from elsewhere (`--transformer-path`): their folder needs
    only its config.json."""
    import torch

    classes: dict[str, type] = {}
    if any(name in processor_substitutes.SUBSTITUTED for _, name in spec.components.values()):
        processor_substitutes.install_processor_substitutes()
    for key, (library, class_name) in spec.components.items():
        cls = _component_class(model_path, key, library, class_name)
        classes[key] = cls
        folder = model_path / key
        if not folder.is_dir():
            raise CheckpointError(
                f"checkpoint {model_path}: model_index.json lists component {key!r} ({class_name}) but the "
                f"folder {folder} is missing."
            )
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            _check_config_json(folder, "config.json", key)
            if key not in replaced and not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
                raise CheckpointError(
                    f"checkpoint {model_path}: component {key!r} has no weights in {folder} "
                    "(expected *.safetensors or *.bin)."
                )
        elif "Scheduler" in class_name:
            _check_config_json(folder, "scheduler_config.json", key)
        elif class_name in VOCABULARY_FREE_TOKENIZERS:
            _check_config_json(folder, "tokenizer_config.json", key)
        elif "Tokenizer" in class_name and not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise CheckpointError(
                f"checkpoint {model_path}: tokenizer folder {folder} has none of the tokenizer files "
                f"({', '.join(TOKENIZER_FILES)}); copy the tokenizer files into it."
            )
    return classes


def check_tokenizers(model_path: Path, components: dict[str, Any]) -> None:
    """Refuse near-empty tokenizers: each must cover most of its text encoder's vocabulary."""
    for key, tokenizer in components.items():
        if not key.startswith("tokenizer") or tokenizer is None:
            continue
        encoder = components.get(key.replace("tokenizer", "text_encoder", 1))
        vocab_size = getattr(getattr(encoder, "config", None), "vocab_size", None)
        if vocab_size is None:
            # Multimodal encoders keep it in their text sub-config.
            text_config = getattr(getattr(encoder, "config", None), "text_config", None)
            vocab_size = getattr(text_config, "vocab_size", None)
        try:
            size = len(tokenizer)
        except TypeError:
            continue
        if vocab_size and size < MIN_VOCAB_RATIO * vocab_size:
            raise CheckpointError(
                f"checkpoint {model_path}: tokenizer {model_path / key} has only {size} entries but its text "
                f"encoder expects a vocabulary of {vocab_size}; the tokenizer files are missing or broken "
                "(transformers silently builds an almost empty tokenizer from an incomplete folder)."
            )


# -- loading ------------------------------------------------------------------------------------------


def resolve_placements(
    placement: Placement | Mapping[str, Placement], model_keys: list[str], model_path: Path
) -> dict[str, Placement]:
    """Per model component, where it loads: one placement for all, or a mapping (unnamed keys load to host)."""
    if isinstance(placement, str):
        chosen = dict.fromkeys(model_keys, placement)
    else:
        unknown = sorted(set(placement) - set(model_keys))
        if unknown:
            raise ConfigError(
                f"placement names {unknown}, which checkpoint {model_path} has no model component "
                f"for; its model components are {model_keys}.",
                param="placement",
            )
        chosen = {key: placement.get(key, "host") for key in model_keys}
    bad = sorted({p for p in chosen.values() if p not in PLACEMENTS})
    if bad:
        raise ConfigError(f"placement {bad} is not one of {list(PLACEMENTS)}.", param="placement")
    return chosen


def _load_module(
    cls: type, folder: Path, *, placement: Placement, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    if folder.name == "transformer":
        from diffuserve.models.quantized_files import check_folder_quantization

        method = check_folder_quantization(folder, dtype, device)
        if method is not None:
            if placement == "meta":
                raise ConfigError(_NO_SHARDING.format(what=f"a {method}-quantized transformer"), param="placement")
            logger.info("transformer: %s-quantized weights from %s", method, folder / "config.json")
    if placement == "meta":
        from diffuserve.models.materialize import meta_module

        return meta_module(cls, folder, dtype)
    module = cls.from_pretrained(folder, local_files_only=True, dtype=dtype)
    if placement == "device":
        module = module.to(device)
    return module.eval().requires_grad_(False)


_NO_SHARDING = (
    "{what} cannot be sharded: its packed weights are not plain tensors, so --tp-size and "
    "--use-fsdp-inference refuse it; serve it on one GPU per replica (CFG parallel and sequence parallel replicate "
    "the weights and are fine)."
)


def _load_transformer_file(
    transformer_path: Path,
    cls: type,
    model_path: Path,
    *,
    placement: Placement,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.nn.Module:
    from diffuserve.models.quantized_files import load_transformer_file
    from diffuserve.models.single_file import describe_file

    info = describe_file(transformer_path)
    if placement == "meta":
        raise ConfigError(_NO_SHARDING.format(what=f"--transformer-path ({info.method})"), param="transformer_path")
    return load_transformer_file(info, cls, model_path, dtype=dtype, device=device, to_device=placement == "device")


def load_components(
    model_path: Path,
    spec: registry.ModelSpec,
    *,
    device: torch.device,
    dtype: torch.dtype,
    placement: Placement | Mapping[str, Placement] = "device",
    transformer_path: Path | None = None,
) -> dict[str, Any]:
    """Load every component listed in model_index.json (local files only), checked and placed; with
    `transformer_path`, the transformer comes from that single file (`models/quantized_files.py`)."""
    import torch

    replaced = frozenset({"transformer"} if transformer_path is not None else ())
    classes = check_checkpoint(model_path, spec, replaced=replaced)
    model_keys = [k for k, c in classes.items() if isinstance(c, type) and issubclass(c, torch.nn.Module)]
    placements = resolve_placements(placement, model_keys, model_path)
    loaded: dict[str, Any] = {}
    for key, cls in classes.items():
        folder = model_path / key
        try:
            if key in replaced:
                loaded[key] = _load_transformer_file(
                    transformer_path, cls, model_path, placement=placements[key], device=device, dtype=dtype
                )
            elif key in placements:
                loaded[key] = _load_module(cls, folder, placement=placements[key], device=device, dtype=dtype)
            elif hasattr(cls, "from_pretrained"):
                loaded[key] = cls.from_pretrained(folder, local_files_only=True)
            else:
                loaded[key] = cls.from_config(cls.load_config(folder))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any library error becomes one clear start-up error
            raise CheckpointError(
                f"checkpoint {model_path}: cannot load component {key!r} ({spec.components[key][1]}) from "
                f"{folder}: {type(exc).__name__}: {exc}"
            ) from exc
    check_tokenizers(model_path, loaded)
    return loaded


def _place_unmanaged(pipeline: Pipeline, components: dict[str, Any], device: torch.device) -> None:
    """Host-loaded modules the pipeline keeps outside `pipeline.components` have no residency owner to
    place them: they go to the device here, so host placement never leaves a module computing on the host."""
    import torch

    managed = {id(m) for m in pipeline.components.values()}
    for key, module in components.items():
        if isinstance(module, torch.nn.Module) and id(module) not in managed:
            if any(t.is_meta for t in module.parameters()):
                raise ConfigError(
                    f"placement meta for component {key!r}: the pipeline does not manage it, so "
                    "nothing would materialize it; load it to host or device.",
                    param="placement",
                )
            module.to(device)


def _native_class(family: str) -> type:
    module_name, _, class_name = registry.native_families()[family].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _quantize(components: Mapping[str, Any], quantization: Mapping[str, Any] | None, device: Any) -> None:
    """The plan's online quantization of a native pipeline's components (before anything else sees them)."""
    if quantization:
        from diffuserve.quant.apply import quantize_components

        quantize_components(components, quantization, device)


def _transformer_file(spec: registry.ModelSpec, transformer_path: str | Path | None) -> Path | None:
    if transformer_path is None:
        return None
    from diffuserve.models.single_file import check_family

    check_family(spec.family)
    return Path(transformer_path).expanduser()


def _backend_preloaded(
    model_path: Path,
    spec: registry.ModelSpec,
    transformer_file: Path | None,
    placement: Placement | Mapping[str, Placement],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The diffusers backend's checks, and the modules it is handed rather than loading (a --transformer-path)."""
    classes = check_checkpoint(
        model_path, spec, replaced=frozenset({"transformer"} if transformer_file is not None else ())
    )
    if placement not in ("device", "host"):
        raise ConfigError(
            f"placement {placement!r}: the diffusers backend loads the whole pipeline at once, "
            "to the device or to host; meta or per-component placement needs a native family.",
            param="placement",
        )
    preloaded = {}
    if transformer_file is not None:
        preloaded["transformer"] = _load_transformer_file(
            transformer_file,
            classes["transformer"],
            model_path,
            placement=placement,
            device=device,
            dtype=dtype,
        )
    return preloaded


def _load_diffusers_backend(
    model_path: Path,
    spec: Any,
    torch_device: Any,
    torch_dtype: Any,
    placement: Any,
    suggested: Any,
    *,
    quantization: Mapping[str, Any] | None,
    transformer_file: Path | None,
) -> Pipeline:
    """Any other diffusers pipeline, unmodified (quantized while it loads when the plan says so; its transformer
    from a `--transformer-path` file when one is given)."""
    from diffuserve.pipelines.diffusers_backend import DiffusersBackendPipeline

    preloaded = _backend_preloaded(model_path, spec, transformer_file, placement, torch_device, torch_dtype)
    try:
        pipeline = DiffusersBackendPipeline.from_pretrained(
            model_path,
            family=spec.family,
            device=torch_device,
            dtype=torch_dtype,
            to_device=placement == "device",
            # Handed in rather than applied afterwards: the adapter snaps a suggested size to its size
            # multiple and ignores frames on an image pipeline.
            suggested_defaults=suggested,
            quantization=quantization,
            components=preloaded,
        )
    except CheckpointError as exc:
        # Name the class and the way out: a native family under another class name needs --model-id.
        native = ", ".join(sorted(registry.native_families()))
        if spec.family in registry.native_families():
            raise
        raise CheckpointError(
            f"{exc.message} Pipeline class {spec.pipeline_class!r} has no native adapter and did not load "
            f"through the diffusers backend. Native families: {native}; if the checkpoint is one of them "
            "under another class name, pass --model-id naming it (e.g. --model-id FLUX.1-dev)."
        ) from exc
    check_tokenizers(model_path, dict(pipeline.pipe.components))
    return pipeline


def load_pipeline(
    model_path: str | Path,
    *,
    model_id: str | None = None,
    backend: str = "auto",
    device: str = "cpu",
    dtype: str = "float32",
    placement: Placement | Mapping[str, Placement] = "device",
    quantization: Mapping[str, tuple[str, Sequence[str]]] | None = None,
    transformer_path: str | Path | None = None,
) -> Pipeline:
    """Load the checkpoint at `model_path` and return the pipeline that serves it.

    `backend` is auto | native | diffusers (auto = native when the family has an adapter). `device` is
    where the pipeline computes; `placement` is where the model components' weights go at load: `device`,
    `host` or `meta` for all, or a mapping from component key to placement (keys it does not name load to
    `host`), e.g. `{"transformer": "meta"}` for FSDP. The diffusers backend takes `device` or `host` only.
    `quantization` (component -> (method, never-quantize globs), from the plan) quantizes those components' Linear
    layers as they load (`quant/`). `transformer_path`: the denoiser from that single file.
    Raises CheckpointError (broken folder) or ConfigError (bad flag) with the fix in the message.
    """
    model_path = Path(model_path).expanduser()
    torch_dtype = parse_dtype(dtype)
    torch_device = parse_device(device)
    spec = registry.resolve_model(model_path, model_id=model_id, backend=backend)
    transformer_file = _transformer_file(spec, transformer_path)  # a refused family fails before any loading
    logger.info("Loading %s (%s, family=%s, backend=%s)", model_path, spec.pipeline_class, spec.family, spec.backend)
    # A checkpoint's own suggestions (tiny test models: `_diffuserve_defaults`) beat the family's published
    # defaults on both backends. The loader reads them, so no adapter reaches back into models/.
    if spec.backend == "native" and not spec.components:
        # A native family with its own folder layout (Hunyuan3D-2): the adapter reads the folder itself.
        folder_pipeline = _native_class(spec.family).from_folder(
            model_path, model_id=model_id, device=torch_device, dtype=torch_dtype
        )
        _quantize(folder_pipeline.components, quantization, torch_device)
        return folder_pipeline
    suggested = registry.read_suggested_defaults(model_path)
    if spec.backend == "native":
        components = load_components(
            model_path,
            spec,
            device=torch_device,
            dtype=torch_dtype,
            placement=placement,
            transformer_path=transformer_file,
        )
        _quantize(components, quantization, torch_device)
        # Pipeline-level settings of model_index.json (Wan2.2's boundary_ratio, expand_timesteps) ride along
        # with the components, as diffusers passes them to the pipeline's __init__.
        index = registry.read_model_index(model_path)
        components.update({k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)})
        try:
            from diffuserve.pipelines.recipe import RecipePipeline

            adapter = _native_class(spec.family).from_components(components, device=torch_device, dtype=torch_dtype)
            pipeline = RecipePipeline(adapter)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {model_path}: {exc.message}") from exc
        _place_unmanaged(pipeline, components, torch_device)
        if suggested:
            pipeline.defaults = dataclasses.replace(pipeline.defaults, **suggested)
    else:
        pipeline = _load_diffusers_backend(
            model_path,
            spec,
            torch_device,
            torch_dtype,
            placement,
            suggested,
            quantization=quantization,
            transformer_file=transformer_file,
        )
    return pipeline
