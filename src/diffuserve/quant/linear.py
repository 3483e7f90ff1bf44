"""`QuantizedLinear`: a `torch.nn.Linear` whose weight is stored quantized, as plain tensors.

Why this shape (DESIGN.md §8 "A quantized Linear is still a Linear to the rest"):

- It IS an `nn.Linear` (`in_features`, `out_features`, `weight`, `bias`), so the LoRA loader's checks, the per-row
  LoRA hook (which wraps `forward` and adds the adapter delta in the compute dtype after the quantized matmul),
  DTensor's `ColwiseParallel` / `RowwiseParallel` and every `isinstance(m, nn.Linear)` see a Linear.
- Its tensors are plain parameters: `weight` (int8 or float8_e4m3fn, (out, in)), `weight_scale` (fp32, (out,), one
  per output row) and `bias` (compute dtype). torchao's `quantize_` would store the weight as a tensor subclass
  (`Int8Tensor`, `Float8Tensor`); the residency manager (runtime/weights.py) detaches a layer by swapping each
  parameter's `.data` for a placeholder and counts bytes as `numel() * element_size()`, which a wrapper subclass
  defeats (the swap loses the subclass, and its element size is the logical dtype's, so the ledger would count
  bf16 bytes). Plain tensors move, pin and count as the quantized bytes they are.
- Tensor parallel (`parallel/quantized.py`): the plan cuts its plain tensors by hand, like its styles would cut a
  Linear's: column-wise, weight, scales and bias keep this rank's output rows; row-wise, the weight keeps this
  rank's input columns and the scales stay whole (every rank's partial sum needs all its output rows' scales).
  FSDP2 `fully_shard` shards weight and scale on dim 0 alike (it all-gathers mixed dtypes as bytes).
- `torch.compile`: the forward is one function of plain tensors chosen at load (`kernel`, a str attribute), with
  no data-dependent branches, so a compiled block traces through it without a graph break per layer.

The maths and the torchao pieces it uses are in `quant/methods.py`.
"""

from __future__ import annotations

import torch

from diffuserve.quant.methods import KERNELS, kernel_for, quantize_weight

PACKED_BLOCKS = ("_tp_packed_col_blocks", "_tp_packed_row_blocks")
"""Attributes diffusers sets on a fused Linear for its tensor-parallel plan (`PackedRowwiseParallel` of FLUX's
single blocks' `proj_out`); the quantized layer keeps them, or the plan cannot cut it."""


class QuantizedLinear(torch.nn.Linear):
    """A Linear with a quantized weight and per-output-row scales; the forward returns the compute dtype."""

    def __init__(self, linear: torch.nn.Linear, method: str, device: torch.device) -> None:
        torch.nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight, scale = quantize_weight(method, linear.weight)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        """fp32 (out_features,): output row i is `scale[i] * (weight[i] . x)`."""
        self.bias = linear.bias
        for attr in PACKED_BLOCKS:  # a fused projection's TP layout (diffusers sets it on the Linear at init)
            if hasattr(linear, attr):
                setattr(self, attr, getattr(linear, attr))
        self.method = method
        """fp8 | int8 | int8-dynamic."""
        dtype = linear.weight.dtype  # the compute dtype the component was loaded in
        self.kernel = kernel_for(method, torch.device(device), self.in_features, self.out_features, dtype)
        """The forward chosen for the serving device (`methods.KERNELS`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KERNELS[self.kernel](x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}, kernel={self.kernel}"
