"""`--quantization` on the diffusers backend: diffusers' own `PipelineQuantizationConfig`, one torchao config per
quantized component, handed to `DiffusionPipeline.from_pretrained` (the pipeline quantizes while it loads).

The methods map to torchao's configs: `int8` -> `Int8WeightOnlyConfig`, `int8-dynamic` ->
`Int8DynamicActivationInt8WeightConfig`, `fp8` -> `Float8DynamicActivationFloat8WeightConfig(PerRow())` on CUDA
sm89+ and `Float8WeightOnlyConfig` elsewhere — what the native layers compute. A diffusers model component gets
diffusers' `TorchAoConfig`, a transformers one transformers' `TorchAoConfig`; any other component (a pipeline whose
parts are not diffusers / transformers models) is refused naming the family.

Never-quantize globs become the exact module names they match in the component's safetensors header: both libraries
take `modules_to_not_convert` as names (diffusers matches `name.` anywhere in a parameter's name, so a kept module
also keeps same-named modules deeper down: more stays in high precision, never less).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diffuserve.errors import ConfigError
from diffuserve.quant.methods import ao, fp8_gemm_available


def _torchao_config(method: str, device: torch.device) -> Any:
    ao()  # torchao imported quietly once
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if method == "int8":
        return Int8WeightOnlyConfig()
    if method == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    if fp8_gemm_available(device):
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Float8WeightOnlyConfig()


def _kept_modules(folder: Path, keep: Sequence[str]) -> list[str]:
    """The Linear-weight modules of a component folder that a never-quantize glob matches (from its headers)."""
    from diffuserve.config.model_profiles import read_safetensors_header

    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        for tensor, entry in read_safetensors_header(path).items():
            module, _, leaf = tensor.rpartition(".")
            linear = leaf == "weight" and len(entry.get("shape", [])) == 2
            if linear and any(fnmatch.fnmatchcase(module, p) for p in keep):
                names.add(module)
    return sorted(names)


def pipeline_quantization_config(
    model_path: Path, wanted: Mapping[str, tuple[str, Sequence[str]]], family: str, device: torch.device
) -> Any:
    """diffusers' `PipelineQuantizationConfig` for the wanted components (component -> (method, kept globs))."""
    import diffusers
    import transformers

    index = json.loads((Path(model_path) / "model_index.json").read_text())
    mapping: dict[str, Any] = {}
    for name, (method, keep) in wanted.items():
        library = (index.get(name) or [None, None])[0]
        kept = _kept_modules(Path(model_path) / name, keep) or None
        quant_type = _torchao_config(method, torch.device(device))
        if library == "diffusers":
            mapping[name] = diffusers.TorchAoConfig(quant_type=quant_type, modules_to_not_convert=kept)
        elif library == "transformers":
            mapping[name] = transformers.TorchAoConfig(quant_type=quant_type, modules_to_not_convert=kept)
        else:
            raise ConfigError(
                f"--quantization {name}={method}: the diffusers backend's {family} pipeline cannot quantize {name} "
                f"(a {library or 'non-model'} component, not a diffusers or transformers model); quantize its "
                "diffusers / transformers components only.",
                param="quantization",
            )
    return diffusers.PipelineQuantizationConfig(quant_mapping=mapping)
