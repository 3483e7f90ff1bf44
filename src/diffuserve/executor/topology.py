"""Who is who among the ranks: replicas, their leaders, and the process groups of each parallel mode.

Global ranks are laid out as a (dp, cfg, ring, ulysses, tp) grid, tp innermost (the ranks that talk most sit
next to each other, on one host when they can). Replica `r` is the block of `ranks_per_replica` consecutive
ranks starting at `r * ranks_per_replica`; its first rank is its leader (rank 0 leads replica 0 and also
hosts the engine). FSDP shards over a replica's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Topology:
    """This rank's place in the deployment (plain data: picklable, no torch)."""

    world_size: int
    """All ranks, over every host (= --num-gpus)."""
    rank: int
    """This rank's global index."""
    local_rank: int
    """This rank's index on its host (its cuda:N)."""
    dp_size: int = 1
    """Data-parallel replicas."""
    cfg: int = 1
    """CFG-parallel degree (1 or 2)."""
    ring: int = 1
    """Ring-attention degree."""
    ulysses: int = 1
    """Ulysses degree."""
    tp: int = 1
    """Tensor-parallel degree."""

    @property
    def ranks_per_replica(self) -> int:
        return self.world_size // self.dp_size

    @property
    def replica(self) -> int:
        return self.rank // self.ranks_per_replica

    def replica_ranks(self, replica: int | None = None) -> tuple[int, ...]:
        r = self.replica if replica is None else replica
        return tuple(range(r * self.ranks_per_replica, (r + 1) * self.ranks_per_replica))

    @property
    def leader(self) -> int:
        return self.replica_ranks()[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @classmethod
    def from_plan(cls, plan: Any, *, rank: int, local_rank: int) -> Topology:
        degrees = (2 if plan.enable_cfg_parallel else 1) * plan.ring_degree * plan.ulysses_degree * plan.tp_size
        per_replica = plan.num_gpus // plan.dp_size
        # FSDP alone (no degree) shards over the replica's ranks, which all run the same batch.
        if degrees not in (1, per_replica):
            raise ValueError(f"degrees {degrees} do not fill a replica of {per_replica} ranks")
        return cls(
            world_size=plan.num_gpus,
            rank=rank,
            local_rank=local_rank,
            dp_size=plan.dp_size,
            cfg=2 if plan.enable_cfg_parallel else 1,
            ring=plan.ring_degree,
            ulysses=plan.ulysses_degree,
            tp=plan.tp_size,
        )


@dataclass
class RankGroups:
    """The process groups this rank takes part in (built identically, in the same order, on every rank)."""

    control: Any
    """gloo group of this rank's replica: the leader's per-step stop decision is broadcast on it."""
    replica_mesh: Any
    """1-D DeviceMesh of this rank's replica (FSDP shards over it)."""
    cfg: Any
    """Group of this rank's CFG pair (None when CFG parallel is off)."""
    ring: Any
    """Group of this rank's ring peers (None when the degree is 1)."""
    ulysses: Any
    """Group of this rank's Ulysses peers (None when the degree is 1)."""
    tp_mesh: Any
    """1-D DeviceMesh of this rank's tensor-parallel peers (None when the degree is 1)."""


def build_groups(topology: Topology, device_type: str) -> RankGroups:
    """Every rank calls this once, right after the process group is up (new groups are collective calls)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    t = topology
    controls = [dist.new_group(list(t.replica_ranks(r)), backend="gloo") for r in range(t.dp_size)]
    replicas = init_device_mesh(device_type, (t.dp_size, t.ranks_per_replica), mesh_dim_names=("dp", "replica"))
    cfg = ring = ulysses = tp_mesh = None
    if t.cfg * t.ring * t.ulysses * t.tp > 1:
        grid = init_device_mesh(
            device_type,
            (t.dp_size, t.cfg, t.ring, t.ulysses, t.tp),
            mesh_dim_names=("dp", "cfg", "ring", "ulysses", "tp"),
        )
        cfg = grid["cfg"].get_group() if t.cfg > 1 else None
        ring = grid["ring"].get_group() if t.ring > 1 else None
        ulysses = grid["ulysses"].get_group() if t.ulysses > 1 else None
        tp_mesh = grid["tp"] if t.tp > 1 else None
    return RankGroups(
        control=controls[t.replica],
        replica_mesh=replicas["replica"],
        cfg=cfg,
        ring=ring,
        ulysses=ulysses,
        tp_mesh=tp_mesh,
    )
