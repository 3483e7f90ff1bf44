"""Load a pre-quantized denoiser: a `--transformer-path` file, or a folder whose config carries a quantization.

Everything here is diffusers' own loading, chosen per format so that the weights stay as the file ships them:

- GGUF: `from_single_file(file, config=<base>, subfolder="transformer",
  quantization_config=GGUFQuantizationConfig(compute_dtype))` makes each Linear a `GGUFLinear` holding a
  `GGUFParameter` (the packed blocks, uint8); its forward dequantizes the weight for the one matmul.
- Black Forest Labs' fp8r / NVFP4: the same call with `BFLQuantizationConfig`; `BFLFP8RLinear` runs an FP8 GEMM on
  CUDA sm89+, `BFLNVFP4Linear` an FP4 GEMM on Blackwell with FlashInfer; elsewhere each layer is dequantized.
- A plain safetensors file: `from_single_file` at `--dtype`.
- A folder whose `transformer/config.json` holds a `quantization_config` (torchao, ModelOpt, ...): diffusers'
  `from_pretrained` applies it; `check_folder_quantization` refuses, before loading, one it cannot load here.

The file is checked against the base's transformer config before any weight is read: its keys are converted on
meta tensors with diffusers' own single-file key conversion and compared with a meta model built from the config,
so a file for another model fails naming the first mismatched tensor and both shapes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffuserve.errors import ConfigError
from diffuserve.models.single_file import BFL_SCALES, FLAG, TransformerFile

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _error(message: str) -> ConfigError:
    return ConfigError(f"{FLAG}: {message}", param="transformer_path")


def _meta_model(cls: type, config_dir: Path) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls.from_config(cls.load_config(config_dir))


def _converted_shapes(info: TransformerFile, cls: type, config: dict[str, Any], expected: set[str]) -> dict[str, Any]:
    """The file's tensors as diffusers' single-file loading would name them (meta tensors, logical shapes)."""
    import torch
    from diffusers.loaders.single_file_model import (
        SINGLE_FILE_LOADABLE_CLASSES,
        _get_single_file_loadable_mapping_class,
    )

    checkpoint = {
        name: torch.empty(t.shape, device="meta")
        for name, t in info.tensors.items()
        if not (info.format == "bfl" and name.endswith(BFL_SCALES))
    }
    if set(checkpoint) == expected:
        return checkpoint  # already in diffusers' layout: from_single_file does not convert it either
    mapping = _get_single_file_loadable_mapping_class(cls)
    if mapping is None:
        raise _error(f"{cls.__name__} cannot be loaded from a single file by this diffusers.")
    convert = SINGLE_FILE_LOADABLE_CLASSES[mapping]["checkpoint_mapping_fn"]
    try:
        return dict(convert(config=config, checkpoint=dict(checkpoint)))
    except Exception as exc:  # noqa: BLE001 - a converter fails on keys it does not know with any error type
        raise _error(
            f"{str(info.path)!r}: its tensor names are not a {cls.__name__} checkpoint that diffusers can convert "
            f"({type(exc).__name__}: {exc}); is it the transformer of the model at --model-path?"
        ) from exc


def check_shapes(info: TransformerFile, cls: type, base: Path) -> None:
    """Refuse a file whose tensors do not fit the base's transformer config, naming the first mismatch."""
    config_dir = base / "transformer"
    config = cls.load_config(config_dir)
    expected = {name: tuple(t.shape) for name, t in _meta_model(cls, config_dir).state_dict().items()}
    found = _converted_shapes(info, cls, dict(config), set(expected))
    for name, shape in expected.items():
        have = found.get(name)
        if have is None:
            raise _error(
                f"{str(info.path)!r} has no tensor for {name} {list(shape)} of the {cls.__name__} that "
                f"{config_dir / 'config.json'} describes; the file is for another model or another size of it."
            )
        if tuple(have.shape) != shape:
            raise _error(
                f"{str(info.path)!r}: tensor {name} has shape {list(have.shape)} in the file, but "
                f"{config_dir / 'config.json'} makes it {list(shape)}; the file is for another size of the model."
            )


def _quantization_config(info: TransformerFile, dtype: torch.dtype) -> Any:
    if info.format == "gguf":
        from diffusers import GGUFQuantizationConfig

        return GGUFQuantizationConfig(compute_dtype=dtype)
    if info.format == "bfl":
        from diffusers import BFLQuantizationConfig

        return BFLQuantizationConfig(compute_dtype=dtype)
    return None


def execution_note(info: TransformerFile, device: torch.device) -> str:
    """How the quantized layers compute on `device` (the start-up log line says it)."""
    import torch

    cuda = device.type == "cuda" and torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(device) if cuda else (0, 0)
    if info.method == "bfl:nvfp4":
        from diffusers.utils import is_flashinfer_available

        if cuda and capability[0] >= 10 and is_flashinfer_available():
            return "NVFP4 GEMM through FlashInfer (Blackwell)"
        why = (
            "no CUDA device"
            if not cuda
            else f"sm{capability[0]}{capability[1]}" + ("" if capability[0] >= 10 else " is not Blackwell")
        )
        if cuda and capability[0] >= 10:
            why = "FlashInfer is not installed"
        return f"each layer dequantized to the compute dtype for its matmul ({why}: no FP4 GEMM)"
    if info.method == "bfl:fp8r":
        if cuda and capability >= (8, 9):
            return "FP8 GEMM through torch._scaled_mm (per-row activation scales)"
        return "each layer dequantized to the compute dtype for its matmul (no FP8 tensor cores here)"
    if info.format == "gguf":
        from diffusers.quantizers.gguf import utils as gguf_utils

        kernels = cuda and gguf_utils.ops is not None
        how = "ggml CUDA kernels" if kernels else "pure torch"
        return f"weights stay in GGUF blocks, each layer dequantized for its matmul ({how})"
    return "unquantized"


def load_transformer_file(
    info: TransformerFile, cls: type, base: Path, *, dtype: torch.dtype, device: torch.device, to_device: bool
) -> torch.nn.Module:
    """The transformer from `info`'s file over the base folder's config: checked, loaded, placed."""
    check_shapes(info, cls, base)
    quantization = _quantization_config(info, dtype)
    kwargs: dict[str, Any] = {"quantization_config": quantization} if quantization is not None else {}
    try:
        module = cls.from_single_file(
            str(info.path),
            config=str(base),
            subfolder="transformer",
            torch_dtype=dtype,
            local_files_only=True,
            **kwargs,
        )
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - one clear start-up error for any library failure
        raise _error(f"{str(info.path)!r} did not load as {cls.__name__}: {type(exc).__name__}: {exc}") from exc
    if to_device:
        module = module.to(device)  # never .to(dtype): that would cast the FP8 weights of a BFL file
    logger.info(
        "transformer: %s from %s (%d tensors quantized); %s",
        info.method,
        info.path,
        sum(info.quant_types.values()),
        execution_note(info, device),
    )
    return module.eval().requires_grad_(False)


def folder_quantization(folder: Path) -> dict[str, Any] | None:
    """The `quantization_config` of a component folder's config.json, if any."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return quantization if isinstance(quantization, dict) else None


def check_folder_quantization(folder: Path, dtype: torch.dtype, device: torch.device) -> str | None:
    """The method of a quantized diffusers folder, refusing (before loading) one diffusers cannot load here."""
    quantization = folder_quantization(folder)
    if quantization is None:
        return None
    method = str(quantization.get("quant_method", "?"))
    if method == "modelopt" and device.type != "cuda":
        # Measured with nvidia-modelopt 0.37: a saved FP8 folder loads as plain Linears holding float8 weights,
        # whose forward fails on a CPU ("self and mat2 must have the same dtype").
        raise ConfigError(
            f"--model-path: {folder / 'config.json'} is ModelOpt-quantized (quant_method 'modelopt'); its layers "
            "compute only on CUDA. Serve it with --device cuda, or use a GGUF / torchao checkpoint on this device.",
            param="model_path",
        )
    from diffusers.quantizers.auto import DiffusersAutoQuantizer

    try:
        quantizer = DiffusersAutoQuantizer.from_config(dict(quantization))
        quantizer.validate_environment(torch_dtype=dtype, device_map=None)
    except Exception as exc:  # noqa: BLE001 - ValueError (unknown method), ImportError / RuntimeError (no package, no GPU)
        raise ConfigError(
            f"--model-path: {folder / 'config.json'} carries a quantization_config (quant_method {method!r}) that "
            f"diffusers cannot load here: {type(exc).__name__}: {exc}",
            param="model_path",
        ) from exc
    return method
