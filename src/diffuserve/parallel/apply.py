"""The plan's parallel modes applied to this rank's loaded pipeline, on the groups of executor/topology.py.

Two phases, around the residency manager (launch/setup.load_serving_pipeline):
  1. `shard_weights` — tensor parallel (weights become DTensor shards), then FSDP (whole blocks) — on the
     host-loaded model, BEFORE residency places anything: each shard goes to the rank's device as it is cut, so
     the device never holds the whole DiT.
  2. `apply_parallelism` — the sequence split (around attention), then CFG parallel (around each step's two
     branches) — after residency, whose hooks they wrap.
Every rank of a replica calls both with the same plan, in the same order, so the collectives inside line up.
"""

from __future__ import annotations

from typing import Any

from diffuserve.errors import ConfigError


def _require_native(pipeline: Any, plan: Any) -> None:
    parallel = plan.tp_size > 1 or plan.sp_degree > 1 or plan.enable_cfg_parallel or plan.use_fsdp_inference
    if parallel and not pipeline.capabilities.split_over_ranks:
        raise ConfigError(
            f"the {pipeline.family} model runs on the diffusers backend, whose denoising loop cannot be "
            "split over ranks; serve it with --dp-size (one replica per rank) or use a native family.",
            param="num_gpus",
        )


def shard_weights(pipeline: Any, plan: Any, groups: Any, *, device_type: str) -> list[str]:
    """Phase 1: tensor parallel, then FSDP, on the host-loaded model; returns what was applied (for the log)."""
    _require_native(pipeline, plan)
    applied: list[str] = []
    if plan.tp_size > 1:
        from diffuserve.parallel.tensor import enable_tensor_parallel

        enable_tensor_parallel(pipeline, mesh=groups.tp_mesh)
        applied.append(f"tensor parallel {plan.tp_size}")
    if plan.use_fsdp_inference:
        from diffuserve.parallel.fsdp import shard_denoisers

        keys = shard_denoisers(pipeline, mesh=groups.replica_mesh, device_type=device_type)
        applied.append(f"fsdp ({', '.join(keys)} over {plan.ranks_per_replica} ranks)")
    return applied


def apply_parallelism(pipeline: Any, plan: Any, groups: Any) -> list[str]:
    """Phase 2: the sequence split and CFG parallel, after residency; returns what was applied (for the log)."""
    _require_native(pipeline, plan)
    applied: list[str] = []
    if plan.sp_degree > 1:
        from diffuserve.parallel.sequence import enable_sequence_parallel

        enable_sequence_parallel(pipeline, ulysses_group=groups.ulysses, ring_group=groups.ring)
        applied.append(f"sequence parallel (ulysses {plan.ulysses_degree} x ring {plan.ring_degree})")
    if plan.enable_cfg_parallel:
        from diffuserve.parallel.cfg_parallel import enable_cfg_parallel

        enable_cfg_parallel(pipeline, groups.cfg)
        applied.append("cfg parallel")
    return applied
