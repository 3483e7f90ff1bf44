"""The plan's parallel modes applied to this rank's loaded pipeline, on the groups of executor/topology.py.

Order matters: tensor parallel first (it replaces weights by DTensor shards), then the sequence split (around
attention), then CFG parallel (around each step's two branches), then FSDP (it wraps whole blocks). Every rank
of a replica calls this with the same plan, in the same order, so the collectives inside line up.
"""

from __future__ import annotations

from typing import Any

from diffuserve.errors import ConfigError


def apply_parallelism(pipeline: Any, plan: Any, groups: Any, *, device_type: str) -> list[str]:
    """Attach the plan's parallel modes to `pipeline`; returns what was applied (for the log)."""
    applied: list[str] = []
    parallel = plan.tp_size > 1 or plan.sp_degree > 1 or plan.enable_cfg_parallel or plan.use_fsdp_inference
    if parallel and not hasattr(pipeline, "cfg_parallel"):
        raise ConfigError(f"the {pipeline.family} model runs on the diffusers backend, whose denoising loop cannot be "
                          "split over ranks; serve it with --dp-size (one replica per rank) or use a native family.",
                          param="num_gpus")
    if plan.tp_size > 1:
        from diffuserve.parallel.tensor import enable_tensor_parallel

        enable_tensor_parallel(pipeline, mesh=groups.tp_mesh)
        applied.append(f"tensor parallel {plan.tp_size}")
    if plan.sp_degree > 1:
        from diffuserve.parallel.sequence import enable_sequence_parallel

        enable_sequence_parallel(pipeline, ulysses_group=groups.ulysses, ring_group=groups.ring)
        applied.append(f"sequence parallel (ulysses {plan.ulysses_degree} x ring {plan.ring_degree})")
    if plan.enable_cfg_parallel:
        from diffuserve.parallel.cfg_parallel import enable_cfg_parallel

        enable_cfg_parallel(pipeline, groups.cfg)
        applied.append("cfg parallel")
    if plan.use_fsdp_inference:
        from diffuserve.parallel.fsdp import shard_denoisers

        keys = shard_denoisers(pipeline, mesh=groups.replica_mesh, device_type=device_type)
        applied.append(f"fsdp ({', '.join(keys)} over {plan.ranks_per_replica} ranks)")
    return applied
