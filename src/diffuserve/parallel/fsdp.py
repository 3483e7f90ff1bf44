"""FSDP inference: the DiT's weights sharded over the ranks with FSDP2 (`fully_shard`), gathered per block.

Each repeated block of the denoiser (its layer containers from the family spec's one layer table) is
sharded on its own, then the root, so a forward all-gathers one block at a time and frees it after
(`reshard_after_forward`), which is what lets a DiT larger than one device run. Every rank runs the same
batch with the same inputs; the arithmetic is the unsharded model's, so outputs are bit-identical to the
single-process run (tested over gloo). On CPU the host is the device, so the win is correctness here and
memory on GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from diffuserve.errors import ConfigError
from diffuserve.runtime.layerwise import default_layer_specs

if TYPE_CHECKING:
    from diffuserve.pipelines.base import Pipeline


def shard_denoisers(
    pipeline: Pipeline,
    *,
    device_type: str = "cpu",
    world_size: int | None = None,
    reshard_after_forward: bool = True,
    mesh: Any = None,
) -> list[str]:
    """FSDP2-shard every denoiser of `pipeline` (block by block, then the root); returns the sharded keys.

    `mesh`: the 1-D DeviceMesh to shard over (a replica's ranks); default: all `world_size` ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    keys = [k for k in pipeline.denoisers if k in pipeline.components]
    if not keys:
        raise ConfigError(
            f"--use-fsdp-inference: the {pipeline.family} model has no native denoiser to shard "
            "(diffusers-backend models run unmodified).",
            param="use_fsdp_inference",
        )
    mesh = mesh if mesh is not None else init_device_mesh(device_type, (world_size or dist.get_world_size(),))
    for key in keys:
        module = pipeline.components[key]
        specs = default_layer_specs(key, module)
        if not specs:
            raise ConfigError(
                f"--use-fsdp-inference: {key} ({type(module).__name__}) declares no repeated blocks to shard.",
                param="use_fsdp_inference",
            )
        for spec in specs:
            for block in module.get_submodule(spec):
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        module.requires_grad_(False)
    from diffuserve.parallel.agreement import FromFirstRank

    pipeline.agree_over(FromFirstRank(mesh.get_group()))  # step caches: every rank decides alike
    return keys


def sharded_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters this rank holds (its local shards)."""
    total = 0
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total
