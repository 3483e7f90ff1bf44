"""Tensor parallel over quantized layers: a `QuantizedLinear`'s plain tensors cut by hand, as the plan says.

DTensor's styles would wrap an int8 / float8 weight as a DTensor and run the layer's forward on DTensors, which
the quantized kernels cannot take (torchao's quantization primitives and `torch._int_mm` / `torch._scaled_mm` have
no sharding rules, nor has the FP8 table lookup). So a planned `QuantizedLinear` gets no DTensor at all: each rank
keeps its own slice of the plain tensors and the unchanged kernels run on them (`resolve_tp_shard_specs` gives the
slice, packed layouts included, the same table the styles and the LoRA slots are cut by):

- column-parallel (q/k/v, the MLP's up projection): weight, per-row scales and bias keep this rank's output rows.
  The input is the whole (replicated) activation and the output this rank's slice of the features, exactly what
  `ColwiseParallel` (with its local output) hands the next op, so no hook is needed.
- row-parallel (the attention output, the MLP's down projection, FLUX single blocks' packed `proj_out`): the
  weight keeps this rank's input columns, the scales stay whole (a partial sum scaled per output row is still a
  partial sum), the bias leaves the forward. A forward hook all-reduces the partial sums over the TP group and then
  adds the bias once, as `RowwiseParallel` does. A LoRA slot's row-parallel partial (`lora/sharding.py`) is added
  inside the forward, before the hook, so it joins the same all-reduce.

Every rank loaded the same checkpoint and quantized it alike, so each cuts its own slices: nothing is scattered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from diffuserve.quant.linear import QuantizedLinear

TP_BIAS = "tp_bias"
"""The buffer a row-parallel quantized layer keeps its bias in (added after the all-reduce)."""


class _ReducePartialSums:
    """The forward hook of a row-parallel quantized layer: the partial sums all-reduced, then the bias."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)
        bias = module._buffers.get(TP_BIAS)
        return output + bias if bias is not None else output


def _plain(tensor: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if tensor is None else torch.nn.Parameter(tensor, requires_grad=False)


def shard_quantized_layers(transformer: torch.nn.Module, specs: dict[str, Any], mesh: Any) -> set[int]:
    """Cut this rank's slices of every planned `QuantizedLinear` of `transformer` over `mesh` (`specs`: the TP plan's
    `resolve_tp_shard_specs`); returns the ids of the layers cut (the plan's DTensor styles must skip them)."""
    from diffusers.hooks.tensor_parallel import _local_shard

    done: set[int] = set()
    for name, layer in transformer.named_modules():
        spec = specs.get(f"{name}.weight")
        if not isinstance(layer, QuantizedLinear) or spec is None or id(layer) in done:
            continue
        cut = _local_shard(layer.weight.detach(), spec.dim, spec.block_sizes, mesh)
        layer.weight = _plain(cut)
        if spec.dim == 0:  # column-parallel: the output rows' scales and bias follow their rows
            layer.weight_scale = _plain(_local_shard(layer.weight_scale.detach(), 0, spec.block_sizes, mesh))
            if layer.bias is not None:
                layer.bias = _plain(_local_shard(layer.bias.detach(), 0, spec.block_sizes, mesh))
            layer.out_features = cut.shape[0]
        else:  # row-parallel: whole scales; the bias after the all-reduce
            bias, layer.bias = layer.bias, None
            if bias is not None:
                layer.register_buffer(TP_BIAS, bias.detach())
            layer.register_forward_hook(_ReducePartialSums(mesh.get_group()))
            layer.in_features = cut.shape[1]
        if layer.kernel == "fp8-gemm" and (layer.in_features % 16 or layer.out_features % 16):
            layer.kernel = "weight-only"  # `torch._scaled_mm` needs both sides of the local shard multiples of 16
        layer.tp_shard = (spec.dim, mesh.size())
        """(the weight's sharded dim, how many ranks share it), for `quantized_sharded_bytes`."""
        done.add(id(layer))
    return done


def quantized_sharded_bytes(transformer: torch.nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole) of the tensor-parallel quantized layers' sharded tensors."""
    held = full = 0
    for layer in transformer.modules():
        shard = getattr(layer, "tp_shard", None)
        if not isinstance(layer, QuantizedLinear) or shard is None:
            continue
        dim, degree = shard
        tensors = [layer.weight, layer.weight_scale, layer.bias] if dim == 0 else [layer.weight]
        local = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        held += local
        full += local * degree
    return held, full
