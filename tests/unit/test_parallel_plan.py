"""The plan's parallel degrees, data-parallel replicas and start-up refusals (pure: no torch, no weights)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from diffuserve.config.deployment import DeploymentArgs, resolve_plan
from diffuserve.config.model_profiles import family_profile
from diffuserve.errors import ConfigError
from diffuserve.executor.topology import Topology
from diffuserve.hardware import describe_hardware


def plan(family: str = "flux", num_gpus: int = 2, heads: int | None = 24, **flags: Any):
    from tests.unit.test_deployment import profile as sized

    # Realistic component sizes where that table has the family.
    base = sized(family) if family in ("flux", "qwen_image", "wan", "sana") else family_profile(family)
    profile = dataclasses.replace(base, dit_attention_heads=heads)
    return resolve_plan(DeploymentArgs(num_gpus=num_gpus, **flags), describe_hardware(num_gpus, 80.0), profile)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"sp_degree": 2}, {"ulysses_degree": 2, "ring_degree": 1, "sp_degree": 2}),  # --sp-degree alone is Ulysses
        ({"num_gpus": 4, "sp_degree": 4, "ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2}),
        ({"num_gpus": 4, "ulysses_degree": 2, "ring_degree": 2}, {"sp_degree": 4, "dp_size": 1}),
        ({"family": "ltx2", "tp_size": 2}, {"tp_size": 2}),  # FLUX.1 reaches the heads check below
        ({"family": "qwen_image"}, {"enable_cfg_parallel": True, "dp_size": 1}),  # auto: CFG family on 2 ranks
        ({"family": "qwen_image", "num_gpus": 4}, {"enable_cfg_parallel": True, "dp_size": 2}),  # the rest: replicas
        ({"num_gpus": 2}, {"enable_cfg_parallel": False, "dp_size": 2}),  # FLUX runs no CFG by default: 2 replicas
        ({"num_gpus": 4, "dp_size": 2, "enable_cfg_parallel": True}, {"dp_size": 2, "enable_cfg_parallel": True}),
        ({"num_gpus": 4, "enable_cfg_parallel": True, "ulysses_degree": 2}, {"sp_degree": 2, "dp_size": 1}),
        ({"use_fsdp_inference": True}, {"dp_size": 1, "use_fsdp_inference": True}),  # FSDP alone spans the ranks
        ({"family": "qwen_image", "enable_cfg_parallel": False, "performance_mode": "manual"}, {"dp_size": 2}),
    ],
)
def test_degrees_and_replicas(kwargs, expected):
    resolved = plan(**kwargs)
    for field, value in expected.items():
        assert getattr(resolved, field) == value, (field, resolved.trace)
    Topology.from_plan(resolved, rank=0, local_rank=0)  # every resolved plan has a topology


@pytest.mark.parametrize(
    ("kwargs", "param", "text"),
    [
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
    ],
)
def test_combinations_that_cannot_run_fail_naming_the_flag(kwargs, param, text):
    with pytest.raises(ConfigError) as err:
        plan(**kwargs)
    assert err.value.param == param and text in err.value.message, err.value.message


def test_topology_replicas_and_groups_layout():
    t = Topology(world_size=8, rank=5, local_rank=5, dp_size=2, cfg=2, ulysses=2)
    assert t.ranks_per_replica == 4 and t.replica == 1 and t.replica_ranks() == (4, 5, 6, 7)
    assert t.leader == 4 and not t.is_leader and t.replica_ranks(0) == (0, 1, 2, 3)


# -- the plan knows the backend: `plan` refuses what start-up refuses, with the same words -------------------------
def backend_plan(family: str, backend: str, num_gpus: int = 2, **flags: Any):
    """The plan for `family` served by `backend` (what `diffuserve plan --backend` and start-up resolve)."""
    from tests.unit.test_deployment import profile as sized

    served = family_profile(family, backend)
    base = sized(family) if family in ("flux", "qwen_image", "wan", "sana") else served
    profile = dataclasses.replace(
        base, backend=served.backend, supports_continuous=served.supports_continuous, dit_attention_heads=24
    )
    return resolve_plan(DeploymentArgs(num_gpus=num_gpus, **flags), describe_hardware(num_gpus, 80.0), profile)


@pytest.mark.parametrize(
    ("family", "backend", "flags", "param"),
    [
        ("flux", "diffusers", {"enable_cfg_parallel": True}, "enable_cfg_parallel"),
        ("qwen_image", "diffusers", {"ulysses_degree": 2}, "ulysses_degree"),
        ("wan", "diffusers", {"ring_degree": 2}, "ring_degree"),
        ("flux", "diffusers", {"sp_degree": 2}, "sp_degree"),
        ("flux", "diffusers", {"tp_size": 2}, "tp_size"),
        ("wan", "diffusers", {"use_fsdp_inference": True}, "use_fsdp_inference"),
        ("glm_image", "auto", {"enable_cfg_parallel": True}, "enable_cfg_parallel"),  # no native adapter: diffusers
        ("hunyuan_video", "auto", {"tp_size": 2}, "tp_size"),
    ],
)
def test_a_diffusers_backend_family_is_refused_every_split_of_its_loop(family, backend, flags, param):
    from diffuserve import family_spec

    with pytest.raises(ConfigError) as err:
        backend_plan(family, backend, **flags)
    message = err.value.message
    assert err.value.param == param and "runs on the diffusers backend" in message, message
    if family_spec.spec_for(family).has_native:
        assert "serve it natively (--backend auto or native)" in message, message
    else:  # the list of native families comes from the specs
        assert family_spec.named_list(family_spec.families_with("has_native")) in message, message


def test_the_backend_turns_auto_parallel_modes_off_instead_of_failing_at_start_up():
    glm = backend_plan("glm_image", "auto")  # a CFG family: auto would pick CFG parallel on a native backend
    assert not glm.enable_cfg_parallel and glm.dp_size == 2
    assert any("runs on the diffusers backend" in line for line in glm.trace), glm.trace
    qwen = backend_plan("qwen_image", "diffusers")
    assert not qwen.enable_cfg_parallel and qwen.dp_size == 2
    assert backend_plan("qwen_image", "auto").enable_cfg_parallel  # the same family natively: CFG parallel
    assert not backend_plan("wan", "diffusers").use_fsdp_inference


def test_backend_native_for_a_family_without_an_adapter_fails_in_the_plan_as_at_load():
    from diffuserve.models.registry import select_backend

    with pytest.raises(ConfigError) as planned:
        family_profile("glm_image", "native")
    with pytest.raises(ConfigError) as loaded:
        select_backend("glm_image", "native")
    assert planned.value.message == loaded.value.message and planned.value.param == "backend"


def test_profiles_carry_the_specs_capabilities_for_their_backend():
    from diffuserve import family_spec

    for name, spec in family_spec.all_specs().items():
        profile = family_profile(name)
        assert profile.backend == ("native" if spec.has_native else "diffusers")
        assert profile.supports_continuous == (spec.supports_continuous and spec.has_native)
        assert profile.cfg_batched == spec.cfg_batched
    assert family_profile("flux").supports_continuous and not family_profile("wan_i2v").supports_continuous
    assert not family_profile("flux", "diffusers").supports_continuous  # the diffusers backend never steps


@pytest.mark.parametrize(
    ("flags", "capability"),
    [
        ({"family": "sd3", "ulysses_degree": 2}, "sequence_parallel"),
        ({"family": "sd3", "tp_size": 2}, "tensor_parallel"),
    ],
)
def test_family_lists_in_refusals_are_generated_from_the_specs(flags, capability):
    from diffuserve import family_spec

    with pytest.raises(ConfigError) as err:
        plan(**flags)
    assert family_spec.named_list(family_spec.families_with(capability)) in err.value.message
