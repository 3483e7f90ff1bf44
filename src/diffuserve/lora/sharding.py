"""Adapter slots under tensor parallel: A and B sharded like their base weight, the LoRA sum on the local shards.

The TP plan shards an adapted Linear one of two ways (`resolve_tp_shard_specs`, the table diffusers shards the
weights by, packed layouts included):

- column-parallel (the weight's out rows split; its input replicated, its output a slice of the out features):
  B's out rows are split the same way, A stays whole; a rank adds `B_local (A x)` to its slice of the output.
- row-parallel (the weight's in columns split; its input a slice, its output a partial sum that the layer's
  output hook all-reduces): A's in columns are split the same way, B stays whole; a rank adds its partial
  `B (A_local x_local)` to the base's partial sum, which the same all-reduce then completes. No extra collective.

Each rank cuts its own slices from the whole slots (every rank read the same adapters), so nothing is scattered.
Under TP the layer's input and output are DTensors (the plan's hooks wrap the module's forward, ours runs inside
them); the sum works on their local tensors and hands the output back as a DTensor of the same layout.

Replicated layers (embeddings, AdaLN, the final projection) keep whole slots and the plain path. FSDP, CFG and
sequence parallel need nothing here: FSDP gathers each block's weights before it runs (the slots are buffers,
replicated on every rank: a few MB), CFG parallel gives each rank whole rows, and the sequence split gives each
rank whole rows of fewer tokens, and the per-row sum is token-wise.
"""

from __future__ import annotations

from typing import Any

import torch

from diffuserve.lora.layers import LORA_DOWN, LORA_HOOK, LORA_UP, current_adapters
from diffuserve.lora.rows import add_rows


class ShardedRows:
    """The adapted layer's per-row sum on the local shards of a tensor-parallel Linear (set as `hook.parallel`)."""

    def __init__(self, column: bool) -> None:
        self.column = column
        """True: column-parallel (B's out rows are split); False: row-parallel (A's in columns are split)."""

    def __call__(self, hook: Any, y: Any, x: Any) -> Any:
        from torch.distributed.tensor import DTensor

        assignment = current_adapters()
        if assignment is None:
            return y
        local_x = x.to_local() if isinstance(x, DTensor) else x
        local_y = y.to_local() if isinstance(y, DTensor) else y
        down, up = hook.down, hook.up
        if down.dtype != local_x.dtype:
            down, up = down.to(local_x.dtype), up.to(local_x.dtype)
        plan = assignment.plan(local_x.shape[0], down.shape[1], local_x.device, local_x.dtype)
        if plan is None:
            return y
        out = add_rows(local_y, local_x, down, up, plan, hook.bank.adapted(hook))
        if not isinstance(y, DTensor):
            return out
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False, shape=y.shape, stride=y.stride())


def adapted_layers(transformer: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, Any]]:
    """Module name -> (the adapted Linear, its LoRA hook), for every layer that holds adapter slots."""
    out = {}
    for name, module in transformer.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(LORA_HOOK) if registry is not None else None
        if hook is not None and LORA_DOWN in module._buffers:
            out[name] = (module, hook)
    return out


def shard_lora_slots(transformer: torch.nn.Module, plan: dict[str, Any], mesh: Any, specs: Any = None) -> int:
    """Cut this rank's slices of the adapter slots of `transformer` (about to be, or just, sharded by the TP
    `plan` over `mesh`), the same way as each layer's base weight; returns how many layers were sharded.

    `specs`: the plan's `resolve_tp_shard_specs`, read before sharding (a quantized layer cut by hand holds plain
    local tensors afterwards, whose shapes are no longer the whole layer's)."""
    from diffusers.hooks.tensor_parallel import _local_shard, resolve_tp_shard_specs
    from torch.distributed.tensor import DTensor

    specs = specs if specs is not None else resolve_tp_shard_specs(transformer, plan, mesh.size())
    sharded = 0
    for name, (module, hook) in adapted_layers(transformer).items():
        for key in (LORA_DOWN, LORA_UP):  # `parallelize_module` made every buffer of a planned Linear a Replicate
            slots = module._buffers[key]  # DTensor; the sum runs on plain local tensors
            if isinstance(slots, DTensor):
                module._buffers[key] = slots.to_local()
        spec = specs.get(f"{name}.weight")
        if spec is None or spec.dim is None:
            continue  # a replicated layer: whole slots, the plain path
        column = spec.dim == 0
        key, dim = (LORA_UP, 1) if column else (LORA_DOWN, 2)  # B (slots, out, rank) / A (slots, rank, in)
        module._buffers[key] = _local_shard(module._buffers[key], dim, spec.block_sizes, mesh)
        hook.parallel = ShardedRows(column)
        sharded += 1
    return sharded
