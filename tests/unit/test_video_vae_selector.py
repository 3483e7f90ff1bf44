"""`video_vae`, the seed's selector for a video model's VAE (`--layerwise-resident-layers video_vae=N`,
`--layerwise-residency-lifetime video_vae=forward|permanent`, and every flag of the same grammar): on a video family it
names the `vae` component (LTX-2's audio VAE is not it); on an image family it is an error naming the flag."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from diffuserve.config.model_profiles import ModelProfile, family_profile
from diffuserve.config.plan import Lifetime, ResidencyMode
from diffuserve.errors import ConfigError
from tests.unit.test_deployment import comp, plan_for, profile


def _video(family: str = "wan") -> ModelProfile:
    comps = [
        comp("transformer", "dit", 28, 40),
        comp("text_encoder", "text_encoder", 11, 24),
        comp("vae", "vae", 0.5, 8),
    ]
    if family == "ltx2":
        comps += [comp("audio_vae", "other", 0.1, 4), comp("vocoder", "other", 0.1)]
    return dataclasses.replace(family_profile(family), components={c.name: c for c in comps})


def _layerwise_vae(prof: ModelProfile, **args: Any):
    return plan_for(prof=prof, gib=80.0, component_residency=["video_vae=layerwise-offload"], **args)


@pytest.mark.parametrize("family", ["wan", "hunyuan_video_15", "ltx2"])
def test_video_vae_names_the_vae_of_a_video_family(family: str) -> None:
    plan = _layerwise_vae(
        _video(family),
        layerwise_resident_layers=["video_vae=3"],
        layerwise_residency_lifetime=["video_vae=permanent"],
    )
    vae = plan.components["vae"]
    assert vae.mode is ResidencyMode.LAYERWISE_OFFLOAD
    assert (vae.resident_layers, vae.lifetime) == (3, Lifetime.PERMANENT)
    assert plan.components["text_encoder"].mode is not ResidencyMode.LAYERWISE_OFFLOAD  # only the VAE was named
    if family == "ltx2":  # the audio VAE is not the video VAE
        assert plan.components["audio_vae"].mode is not ResidencyMode.LAYERWISE_OFFLOAD
    assert any(line.startswith("vae: prefetch 1, 3/8 layers resident (permanent)") for line in plan.trace)


def test_video_vae_equals_its_key_and_a_ratio_works() -> None:
    by_key = _layerwise_vae(
        _video(), layerwise_resident_layers=["vae=0.5"], layerwise_residency_lifetime=["vae=forward"]
    )
    by_alias = _layerwise_vae(
        _video(), layerwise_resident_layers=["video_vae=0.5"], layerwise_residency_lifetime=["video_vae=forward"]
    )
    assert by_key.components["vae"] == by_alias.components["vae"]
    assert by_alias.components["vae"].resident_layers == 4  # 0.5 x 8 layers
    # A key's specificity: the later of `vae=` and `video_vae=` wins, and both beat the group `all`.
    later = _layerwise_vae(_video(), layerwise_resident_layers=["all=1", "vae=2", "video_vae=5"])
    assert later.components["vae"].resident_layers == 5
    assert (
        _layerwise_vae(_video(), layerwise_resident_layers=["video_vae=5", "all=1"]).components["vae"].resident_layers
        == 5
    )


def test_layerwise_offload_components_takes_video_vae() -> None:
    plan = plan_for(prof=_video(), gib=80.0, layerwise_offload_components="transformer,video_vae")
    assert plan.components["vae"].mode is ResidencyMode.LAYERWISE_OFFLOAD


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ({"layerwise_resident_layers": ["video_vae=1"]}, "--layerwise-resident-layers"),
        ({"layerwise_residency_lifetime": ["video_vae=forward"]}, "--layerwise-residency-lifetime"),
        ({"component_residency": ["video_vae=layerwise-offload"]}, "--component-residency"),
    ],
)
def test_video_vae_on_an_image_family_is_an_error_naming_the_flag(args: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        plan_for(prof=profile("flux"), **args)
    assert err.value.param == flag.lstrip("-").replace("-", "_")
    assert err.value.message.startswith(f"{flag}: 'video_vae' selects a video model's VAE")
    assert "no video VAE" in err.value.message and "'vae'" in err.value.message


def test_a_misspelt_video_vae_suggests_it_on_a_video_family_only() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'video_vae'"):
        plan_for(prof=_video(), layerwise_resident_layers=["video_vea=1"])
    with pytest.raises(ConfigError) as err:
        plan_for(prof=profile("flux"), layerwise_resident_layers=["video_vea=1"])
    assert "video_vae" not in err.value.message


def test_the_plan_command_exits_2_naming_the_flag_on_an_image_model(capsys: pytest.CaptureFixture[str]) -> None:
    from diffuserve import cli

    code = cli.main(["plan", "--layerwise-resident-layers", "video_vae=1"])  # the embedded (image) demo model
    assert code == 2
    err = capsys.readouterr().err
    assert "--layerwise-resident-layers: 'video_vae' selects a video model's VAE" in err and "no video VAE" in err
