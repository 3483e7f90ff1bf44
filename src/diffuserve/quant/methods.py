"""The online methods' maths: quantize a weight once, and one Linear's forward from the quantized tensors.

Every function takes and returns plain tensors (see `quant/linear.py` for why). The quantization primitives and the
integer GEMM are torchao's (imported lazily and quietly, `ao()`):

- weights: `choose_qparams_affine` / `quantize_affine` (int8, symmetric, one scale per output row) and
  `_choose_scale_float8` / `_quantize_affine_float8` (FP8 e4m3, one scale per output row), the primitives behind
  torchao's `Int8WeightOnlyConfig`, `Int8DynamicActivationInt8WeightConfig` and `Float8*Config(PerRow())`;
- `int8-dynamic`: each token's activations quantized to int8 with its own absmax scale (ours: torchao's activation
  primitives took 17 % of a W8A8 step here, ~3x this), then the int8 x int8 -> int32 GEMM: `torch._int_mm` on CPU
  and under compile, torchao's `safe_int_mm` (cuBLAS' shape rules with fallbacks) on CUDA — torchao's W8A8 path,
  which STACK.md measured 2.8x faster than fp32 on this CPU;
- `fp8` on CUDA sm89+: per-token FP8 activations and `addmm_float8_unwrapped_inference` (`torch._scaled_mm` with
  row-wise scales), torchao's `Float8DynamicActivationFloat8WeightConfig(PerRow())` path; elsewhere weight-only.

What is ours: the weight-only upcasts (torchao's int8 weight-only linear is the same two lines; its FP8 weight-only
upcast is `Tensor.to`, which this CPU runs ~3x slower than the 256-entry table lookup used here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
_EPS = torch.finfo(torch.float32).eps
"""The smallest scale: an all-zero row (zero-initialised layers exist) quantizes to zeros, never to 0 / 0."""
STORAGE = {"fp8": FP8, "int8": torch.int8, "int8-dynamic": torch.int8}
"""Each method's weight dtype (one byte per element)."""


class _DropTorchaoTensorNote(logging.Filter):
    """diffusers' torchao quantizer module notes at import that torchao 0.18 lacks the tensor classes of older
    serialized checkpoints; nothing we load is one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to import `torchao` Tensor objects" not in record.getMessage()


def quiet_torchao() -> None:
    """Import torchao quietly before diffusers / transformers do (they import it whenever it is installed), so its
    harmless import-time warnings stay out of the user's log; a no-op without torchao."""
    note = logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer")
    if not any(isinstance(f, _DropTorchaoTensorNote) for f in note.filters):
        note.addFilter(_DropTorchaoTensorNote())
    with contextlib.suppress(ImportError):
        ao()


_AO: Any = None
"""torchao's pieces once `ao()` imported them."""


def ao() -> Any:
    """torchao's pieces, imported once. A compiled layer's trace reads the module global (the import below, with
    its logging calls, would break the graph at every quantized layer)."""
    return _AO if _AO is not None else _import_ao()


def _import_ao() -> Any:
    """Import torchao's pieces. Its import logs a failed CUDA-kernel library load on machines without
    those kernels, that triton is missing, and torch logs a pytree deprecation for two of its enums: all harmless,
    kept out of our log. `safe_int_mm` enters a compiled graph whole: dynamo would otherwise trace its Python
    device and shape probes and could break the graph at every int8-dynamic layer; AOT tracing and inductor still
    see its ops."""
    global _AO
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in noisy]
    try:
        for log in noisy:
            log.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8.inference import addmm_float8_unwrapped_inference
            from torchao.kernel.intmm import safe_int_mm
            from torchao.quantization import quant_primitives as qp

            with contextlib.suppress(ImportError):  # what diffusers' / transformers' torchao quantizers import next
                importlib.import_module("torchao.prototype.mx_formats.config")
    finally:
        for log, level in zip(noisy, levels, strict=True):
            log.setLevel(level)
    safe_int_mm = torch.compiler.allow_in_graph(safe_int_mm)
    _AO = SimpleNamespace(qp=qp, safe_int_mm=safe_int_mm, addmm_fp8=addmm_float8_unwrapped_inference)
    return _AO


def _int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per row of a 2-D tensor: (int8 values, (rows, 1) scales)."""
    qp = ao().qp
    block = (1, t.shape[-1])
    scale, zero = qp.choose_qparams_affine(
        t,
        qp.MappingType.SYMMETRIC,
        block,
        torch.int8,
        eps=torch.finfo(torch.float32).eps,
        scale_dtype=torch.float32,
        zero_point_dtype=torch.int8,
    )
    scale = scale.reshape(-1, 1)
    return qp.quantize_affine(t, block, scale, zero.reshape(-1, 1), torch.int8), scale


def quantize_weight(method: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight (out, in) in the method's storage dtype, fp32 scale per output row (out,))."""
    w = weight.detach().float()
    if method == "fp8":
        qp = ao().qp
        scale = qp._choose_scale_float8(w, [1, w.shape[1]], FP8).reshape(-1, 1).float().clamp(min=_EPS)
        return qp._quantize_affine_float8(w, scale, FP8), scale.reshape(-1)
    q, scale = _int8_rows(w)
    return q, scale.reshape(-1)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` (for tests and the byte-free reference path)."""
    return (_upcast(weight, torch.float32) * scale.reshape(-1, 1)).to(dtype)


@functools.cache
def _fp8_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Every FP8 e4m3 bit pattern's value in `dtype` (the two NaN patterns as 0: a quantized weight has none)."""
    table = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return torch.nan_to_num(table, nan=0.0).to(device=device, dtype=dtype)


def _upcast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if weight.dtype == FP8 and weight.device.type == "cpu" and not torch.compiler.is_compiling():
        # A table lookup: this CPU converts float8 -> float ~3x slower than it gathers from 256 entries.
        flat = torch.index_select(_fp8_table(weight.device, dtype), 0, weight.view(torch.uint8).reshape(-1).int())
        return flat.view(weight.shape)
    return weight.to(dtype)


def linear_weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Any) -> torch.Tensor:
    """`fp8` / `int8` weight-only: the weight upcast to the compute dtype, its row scales on the output."""
    y = F.linear(x, _upcast(weight, x.dtype)) * scale.to(x.dtype)
    return y + bias if bias is not None else y


def _int8_tokens(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row (token) to symmetric int8 with its own fp32 scale: torchao's `choose_qparams_affine` +
    `quantize_affine` give the same numbers (<= 1 step of rounding), but their generality costs ~3x here, on every
    call of every layer (measured on the 36M DiT: 17% of a W8A8 step)."""
    rows = rows.float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=_EPS).div_(127.0)
    return torch.round(rows / scale).clamp_(-128, 127).to(torch.int8), scale


def linear_int8_dynamic(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Any) -> torch.Tensor:
    """W8A8: each token's activations to int8 (own scale), an int8 x int8 -> int32 GEMM (`torch._int_mm`, torchao's
    `int_scaled_matmul` minus its CPU u8s8 detour, which measured slower here), both scales on the output."""
    xq, xs = _int8_tokens(x.reshape(-1, x.shape[-1]))
    if xq.device.type == "cpu" or torch.compiler.is_compiling():
        y = torch._int_mm(xq, weight.t()).float()
    else:
        y = ao().safe_int_mm(xq, weight.t()).float()  # cuBLAS' shape rules, with torchao's fallbacks
    y = (y * xs * scale).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


def linear_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Any) -> torch.Tensor:
    """FP8 x FP8 GEMM (CUDA sm89+): per-token FP8 activations, `torch._scaled_mm` with row-wise scales."""
    lib = ao()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    xs = lib.qp._choose_scale_float8(rows, [1, rows.shape[1]], FP8).reshape(-1, 1).float().clamp(min=_EPS)
    xq = lib.qp._quantize_affine_float8(rows, xs, FP8)
    y = lib.addmm_fp8(xq, xs, weight.t(), scale.reshape(1, -1), x.dtype, bias=bias, use_fast_accum=True)
    return y.reshape(*x.shape[:-1], weight.shape[0])


KERNELS = {"weight-only": linear_weight_only, "int8-dynamic": linear_int8_dynamic, "fp8-gemm": linear_fp8_gemm}
"""A quantized layer's forward, by the kernel chosen for it at load (`kernel_for`)."""


def fp8_gemm_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def kernel_for(
    method: str, device: torch.device, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16
) -> str:
    """The forward a layer of this method runs on `device` for compute `dtype`: `_scaled_mm` needs both sides
    multiples of 16, and its row-wise scaling writes bf16 only (a float32 compute dtype stays weight-only)."""
    if method == "int8-dynamic":
        return "int8-dynamic"
    shaped = in_features % 16 == 0 and out_features % 16 == 0
    if method == "fp8" and dtype == torch.bfloat16 and shaped and fp8_gemm_available(device):
        return "fp8-gemm"
    return "weight-only"


def check_device(method: str, device: torch.device) -> str | None:
    """Why `method` cannot run on `device` (its kernels are missing), or None: a tiny probe of the real op."""
    probe = torch.ones(2, 16, device=device)
    with contextlib.suppress(Exception):
        q, s = quantize_weight(method, torch.ones(16, 16, device=device))
        kernel = KERNELS[kernel_for(method, device, 16, 16)]
        kernel(probe, q.to(device), s.to(device), None)
        return None
    what = "torch._int_mm" if method == "int8-dynamic" else "float8 tensors" if method == "fp8" else "int8 tensors"
    return f"{method} needs {what}, which this {device.type} device's torch build does not run"
