"""The typed seams between a pipeline and the code outside `pipelines/` (issue 30 item 2): declared fields and
hand-overs on `pipelines.base.Pipeline`, each refusing with the flag's name where the pipeline cannot take it, and no
`getattr` / `hasattr` probe of a pipeline left outside `pipelines/`. A bare `Pipeline` is a real pipeline that runs
no native denoiser and no ControlNet (as Hunyuan3D's does), so each refusal is the one a served model would get."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from diffuserve.errors import ConfigError
from diffuserve.pipelines.base import Pipeline
from diffuserve.pipelines.controlnet import LoadedControlNet

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "diffuserve"

PROBE = re.compile(r"\b(getattr|hasattr)\((self\.)?_?(pipeline|pipe|adapter|native)\b")
"""A probe of a pipeline object for an attribute it may lack (`getattr(pipeline, "denoisers", ())`)."""


def test_no_pipeline_attribute_is_probed_outside_pipelines_and_families() -> None:
    """Outside `pipelines/` (which probes diffusers' own pipelines) and the adapters, a pipeline is read through
    the fields `Pipeline` declares."""
    found = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in ("pipelines", "families")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PROBE.search(line)
    ]
    assert not found, found


def test_the_base_declares_no_denoiser_and_no_controlnet() -> None:
    pipeline = Pipeline()
    assert (pipeline.denoisers, pipeline.supports_controlnet, dict(pipeline.controlnets)) == ((), False, {})


def test_controlnets_are_refused_naming_the_flag_before_any_weight_is_read(tmp_path: Path) -> None:
    from diffuserve.models.controlnets import install_controlnets

    pipeline = Pipeline()
    pipeline.family = "hunyuan3d"
    missing = tmp_path / "no-such-controlnet"  # were it read, the refusal would name the unreadable config.json
    with pytest.raises(ConfigError) as exc:
        install_controlnets(pipeline, [f"canny={missing}"])
    assert exc.value.param == "controlnet"
    assert exc.value.message.startswith("--controlnet: the hunyuan3d model") and "no ControlNet" in exc.value.message
    assert "--backend native" in exc.value.message and pipeline.components == {}


def test_handed_over_controlnets_are_components_and_attributes_of_their_key() -> None:
    class Controlled(Pipeline):
        supports_controlnet = True

    pipeline = Controlled()
    net = LoadedControlNet(name="canny", key="controlnet_canny", model=torch.nn.Linear(2, 2), class_name="Linear")
    pipeline.use_controlnets([net])
    assert dict(pipeline.controlnets) == {"canny": net}
    assert pipeline.components == {"controlnet_canny": net.model}
    assert pipeline.controlnet_canny is net.model  # type: ignore[attr-defined]
    assert Pipeline().controlnets == {}  # the class default is not shared by the hand-over


@pytest.mark.parametrize("updates", [False, True])
def test_lora_on_a_pipeline_without_denoisers_is_refused_naming_the_flag(updates: bool) -> None:
    from diffuserve.lora.registry import LoraRegistry
    from diffuserve.lora.slots import install_registry

    pipeline = Pipeline()
    pipeline.family = "hunyuan3d"
    registry = LoraRegistry({"style": "/nonexistent/style.safetensors"}, max_loras=1, host_capacity=1)
    flag = "--enable-lora-updates" if updates else "--lora-modules"
    with pytest.raises(ConfigError, match=f"^{flag}: the hunyuan3d pipeline on this backend takes no per-row"):
        install_registry(
            pipeline, "hunyuan3d", registry, max_rank=4, device="cpu", dtype=torch.float32, runtime_updates=updates
        )
    with pytest.raises(ConfigError, match="serve it on the native backend or drop the flag"):
        pipeline.use_lora(None)  # type: ignore[arg-type]


def test_weight_sharding_refuses_a_pipeline_without_native_denoisers_naming_its_flag() -> None:
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence_plans import check_sequence_parallel
    from diffuserve.parallel.tensor import check_tensor_parallel

    pipeline = Pipeline()
    pipeline.family = "hunyuan3d"
    with pytest.raises(ConfigError) as tp:
        check_tensor_parallel(pipeline, 2)
    with pytest.raises(ConfigError) as fsdp:
        shard_denoisers(pipeline, world_size=2)
    with pytest.raises(ConfigError) as sp:
        check_sequence_parallel(pipeline, ulysses_degree=2, ring_degree=1)
    assert (tp.value.param, fsdp.value.param, sp.value.param) == ("tp_size", "use_fsdp_inference", "ulysses_degree")
    assert all("hunyuan3d" in e.value.message for e in (tp, fsdp, sp))
