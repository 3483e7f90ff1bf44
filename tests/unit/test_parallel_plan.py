"""The plan's parallel degrees, data-parallel replicas and start-up refusals (pure: no torch, no weights)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from diffuserve.config.deployment import DeploymentArgs, resolve
from diffuserve.config.model_profiles import family_profile
from diffuserve.errors import ConfigError
from diffuserve.executor.topology import Topology
from diffuserve.hardware import describe_hardware


def plan(family: str = "flux", num_gpus: int = 2, heads: int | None = 24, **flags: Any):
    from tests.unit.test_deployment import profile as sized

    # Realistic component sizes where that table has the family.
    base = sized(family) if family in ("flux", "qwen_image", "wan", "sana") else family_profile(family)
    profile = dataclasses.replace(base, dit_attention_heads=heads)
    return resolve(DeploymentArgs(num_gpus=num_gpus, **flags), describe_hardware(num_gpus, 80.0), profile)


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"sp_degree": 2}, {"ulysses_degree": 2, "ring_degree": 1, "sp_degree": 2}),  # --sp-degree alone is Ulysses
    ({"num_gpus": 4, "sp_degree": 4, "ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2}),
    ({"num_gpus": 4, "ulysses_degree": 2, "ring_degree": 2}, {"sp_degree": 4, "dp_size": 1}),
    ({"tp_size": 2}, {"tp_size": 2}),
    ({"family": "qwen_image"}, {"enable_cfg_parallel": True, "dp_size": 1}),  # auto: CFG family on 2 ranks
    ({"family": "qwen_image", "num_gpus": 4}, {"enable_cfg_parallel": True, "dp_size": 2}),  # the rest: replicas
    ({"num_gpus": 2}, {"enable_cfg_parallel": False, "dp_size": 2}),  # FLUX runs no CFG by default: 2 replicas
    ({"num_gpus": 4, "dp_size": 2, "enable_cfg_parallel": True}, {"dp_size": 2, "enable_cfg_parallel": True}),
    ({"num_gpus": 4, "enable_cfg_parallel": True, "ulysses_degree": 2}, {"sp_degree": 2, "dp_size": 1}),
    ({"use_fsdp_inference": True}, {"dp_size": 1, "use_fsdp_inference": True}),  # FSDP alone spans the ranks
    ({"family": "qwen_image", "enable_cfg_parallel": False, "performance_mode": "manual"}, {"dp_size": 2}),
])
def test_degrees_and_replicas(kwargs, expected):
    resolved = plan(**kwargs)
    for field, value in expected.items():
        assert getattr(resolved, field) == value, (field, resolved.trace)
    Topology.from_plan(resolved, rank=0, local_rank=0)  # every resolved plan has a topology


@pytest.mark.parametrize(("kwargs", "param", "text"), [
    ({"num_gpus": 4, "ulysses_degree": 2}, "num_gpus", "--dp-size 2"),  # explicit degrees must fill the ranks
    ({"num_gpus": 2, "tp_size": 3}, "num_gpus", "3 ranks"),
    ({"num_gpus": 4, "dp_size": 3}, "dp_size", "does not divide"),
    ({"num_gpus": 4, "dp_size": 2, "tp_size": 4}, "dp_size", "multiply to 2"),
    ({"sp_degree": 2, "ulysses_degree": 2, "ring_degree": 2}, "sp_degree", "--ulysses-degree x --ring-degree"),
    ({"ulysses_degree": 2, "heads": 3}, "ulysses_degree", "does not divide the DiT's 3 attention heads"),
    ({"tp_size": 2, "heads": 5}, "tp_size", "5 attention heads"),
    ({"family": "sd3", "ulysses_degree": 2}, "ulysses_degree", "no sequence split"),
    ({"family": "sana", "ring_degree": 2}, "ring_degree", "no sequence split"),
    ({"family": "sd3", "tp_size": 2}, "tp_size", "no tensor-parallel plan"),
    ({"family": "sd3", "enable_cfg_parallel": True}, "enable_cfg_parallel", "doubled batch"),
    ({"use_fsdp_inference": True, "tp_size": 2}, "use_fsdp_inference", "2-D"),
    ({"tp_size": 2, "component_residency": ["dit=layerwise-offload"]}, "tp_size", "resident"),
])
def test_combinations_that_cannot_run_fail_naming_the_flag(kwargs, param, text):
    with pytest.raises(ConfigError) as err:
        plan(**kwargs)
    assert err.value.param == param and text in err.value.message, err.value.message


def test_topology_replicas_and_groups_layout():
    t = Topology(world_size=8, rank=5, local_rank=5, dp_size=2, cfg=2, ulysses=2)
    assert t.ranks_per_replica == 4 and t.replica == 1 and t.replica_ranks() == (4, 5, 6, 7)
    assert t.leader == 4 and not t.is_leader and t.replica_ranks(0) == (0, 1, 2, 3)
