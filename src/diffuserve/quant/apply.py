"""Quantizing a loaded pipeline's components in place, as the plan says (`ComponentPlan.quantization`).

Native backend: each `torch.nn.Linear` of a quantized component whose dotted name no never-quantize glob matches
(`quant_keep`: the family's list, then `--quantization-ignored-layers`) becomes a `QuantizedLinear`, on the host,
right after load and before LoRA, residency, parallelism and compile, which all see it as a Linear. The diffusers
backend quantizes while it loads (`quant/diffusers_config.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from diffuserve.errors import ConfigError
from diffuserve.quant.linear import QuantizedLinear
from diffuserve.quant.methods import check_device

logger = logging.getLogger("diffuserve")

QuantRequest = tuple[str, Sequence[str]]
"""(method, never-quantize globs) of one component."""


@dataclass
class QuantReport:
    """What quantizing one component did (the start-up log line)."""

    component: str
    method: str
    quantized: int = 0
    """Linear layers quantized."""
    kept: int = 0
    """Linear layers a never-quantize pattern kept in the compute dtype."""
    bytes_before: int = 0
    """Bytes of the component's tensors before."""
    bytes_after: int = 0
    """... and after (weights + scales)."""
    kernels: frozenset[str] = frozenset()

    def line(self) -> str:
        mib = 2**20
        how = {
            "weight-only": "weight-only (each weight upcast to the compute dtype for its matmul)",
            "fp8-gemm": "FP8 GEMM (torch._scaled_mm, per-token activation scales)",
            "int8-dynamic": "W8A8 (int8 GEMM, per-token activation scales)",
        }
        runs = "; ".join(how[k] for k in sorted(self.kernels)) or "no layer quantized"
        return (
            f"{self.component}: {self.method} on {self.quantized} Linear layers ({self.kept} kept in the compute "
            f"dtype), {self.bytes_before / mib:.1f} -> {self.bytes_after / mib:.1f} MiB; runs {runs}"
        )


def _nbytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _keeps(name: str, patterns: Sequence[str]) -> bool:
    import fnmatch

    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@torch.no_grad()
def quantize_module(
    module: torch.nn.Module, method: str, keep: Sequence[str], device: torch.device, name: str = "component"
) -> QuantReport:
    """Swap the Linears of `module` for `QuantizedLinear`s (kernels chosen for `device`), in place."""
    report = QuantReport(name, method, bytes_before=_nbytes(module))
    swapped: dict[int, QuantizedLinear] = {}
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not torch.nn.Linear:  # not a subclass someone else owns (LoRA, TP, ours)
                continue
            if _keeps(full, keep):
                report.kept += 1
                continue
            if id(child) not in swapped:  # one module reachable under two names stays one module
                swapped[id(child)] = QuantizedLinear(child, method, device)
                report.quantized += 1
            setattr(parent, child_name, swapped[id(child)])
    report.kernels = frozenset(q.kernel for q in swapped.values())
    report.bytes_after = _nbytes(module)
    return report


def check_methods(wanted: Mapping[str, QuantRequest], device: torch.device | str) -> None:
    """Refuse, naming the flag and before any weight loads, a method whose kernels this device's torch lacks."""
    for name, (method, _) in wanted.items():
        why = check_device(method, torch.device(device))
        if why is not None:
            raise ConfigError(f"--quantization {name}={method}: {why}; pick another method.", param="quantization")


def quantize_components(
    components: Mapping[str, torch.nn.Module], wanted: Mapping[str, QuantRequest], device: torch.device | str
) -> list[QuantReport]:
    """Quantize each wanted component (refusing, naming the flag, a method the device has no kernels for)."""
    device = torch.device(device)
    check_methods(wanted, device)
    reports = []
    for name, (method, keep) in wanted.items():
        module = components.get(name)
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                f"--quantization {name}={method}: the loaded pipeline has no module {name!r} to quantize.",
                param="quantization",
            )
        report = quantize_module(module, method, keep, device, name)
        logger.info("quantization: %s", report.line())
        reports.append(report)
    return reports
