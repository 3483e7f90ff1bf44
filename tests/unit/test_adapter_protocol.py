"""Every native family adapter against the `FamilyAdapter` protocol (`pipelines/adapter.py`).

Each adapter implements the protocol's required parts with its signatures (parameter names included: the recipe
calls some by keyword), may implement its optional parts, and overrides no other method of the recipe beyond the
allow-list below. The allow-list only shrinks: an entry an adapter no longer overrides fails the test until it is
removed, so folding a hook into the protocol or the family spec is recorded here.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from diffuserve.models import registry
from diffuserve.pipelines.adapter import OPTIONAL, REQUIRED, FamilyAdapter, OptionalParts
from diffuserve.pipelines.recipe import RecipePipeline

STILL_OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "flux": (),
    "flux2": (),
    "flux2_klein": (),
    "flux_fill": (),
    "hunyuan3d": ("_denoise", "activation_facts", "describe", "request_facts", "run"),  # its own loop (meshes)
    "hunyuan_video_15": (),
    "hunyuan_video_15_i2v": (),
    "ltx2": (),
    "qwen_image": (),
    "qwen_image_21": (),
    "qwen_image_edit": (),
    "qwen_image_edit_plus": (),
    "sana": (),
    "sd3": (),
    "wan": (),
    "wan_i2v": (),
    "z_image": (),
}
"""Family -> the recipe methods (beyond the protocol's parts) its adapter still overrides. Only shrinks."""

FAMILIES = sorted(registry.native_families())


def _adapter_class(family: str) -> type:
    module_name, _, class_name = registry.native_families()[family].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _recipe_methods() -> set[str]:
    """Methods and properties the recipe (and the pipeline base under it) defines."""
    return {
        name
        for klass in RecipePipeline.__mro__
        if klass is not object
        for name, value in vars(klass).items()
        if not name.startswith("__") and (inspect.isfunction(value) or isinstance(value, property))
    }


def _overridden(cls: type) -> set[str]:
    """The recipe's methods `cls` (or a family class between it and the recipe) defines again."""
    recipe = set(RecipePipeline.__mro__)
    own = {
        name: value
        for klass in cls.__mro__
        if klass not in recipe and klass is not object
        for name, value in vars(klass).items()
        if inspect.isfunction(value) or isinstance(value, property)
    }
    return set(own) & _recipe_methods()


def _parameters(function: object) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]  # type: ignore[arg-type]


def test_every_native_family_is_listed() -> None:
    assert sorted(STILL_OVERRIDDEN) == FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_implements_the_protocol_parts(family: str) -> None:
    cls = _adapter_class(family)
    if not issubclass(cls, RecipePipeline):
        pytest.skip(f"{family} runs its own loop (not the recipe): the protocol does not apply")
    for name in REQUIRED:
        assert name in _overridden(cls), f"{family}: {cls.__name__} does not implement {name}"
        assert _parameters(getattr(cls, name)) == _parameters(getattr(FamilyAdapter, name)), (
            f"{family}: {cls.__name__}.{name} takes other parameters than FamilyAdapter.{name}"
        )
    for name in OPTIONAL:
        if name in _overridden(cls):
            assert _parameters(getattr(cls, name)) == _parameters(getattr(OptionalParts, name)), (
                f"{family}: {cls.__name__}.{name} takes other parameters than OptionalParts.{name}"
            )
    for field in ("family", "denoisers", "decoder", "masked_sequences"):
        assert hasattr(cls, field), f"{family}: {cls.__name__} lacks the protocol's {field}"


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_overrides_nothing_else_of_the_recipe(family: str) -> None:
    extra = _overridden(_adapter_class(family)) - set(REQUIRED) - set(OPTIONAL)
    allowed = set(STILL_OVERRIDDEN[family])
    assert extra <= allowed, (
        f"{family} overrides {sorted(extra - allowed)} of the recipe: implement a FamilyAdapter part "
        "(pipelines/adapter.py) or put the fact in the family spec instead"
    )
    assert allowed <= extra, (
        f"{family} no longer overrides {sorted(allowed - extra)}: remove it from STILL_OVERRIDDEN (the list shrinks)"
    )


def test_recipe_checks_the_protocol_parts_it_calls() -> None:
    """The protocol names the recipe's parts: every part it declares is a method the recipe calls on the adapter."""
    for name in (*REQUIRED, *OPTIONAL):
        assert callable(getattr(RecipePipeline, name)), name
    assert {"family", "denoisers", "decoder", "masked_sequences"} <= set(dir(RecipePipeline))


@pytest.mark.parametrize(
    ("family", "fields", "runs", "scale"),
    [
        ("flux", {"true_cfg_scale": 4.0, "negative_prompt": "blur"}, True, 4.0),
        ("flux", {"true_cfg_scale": 4.0, "negative_prompt": ""}, False, 4.0),
        ("qwen_image", {"true_cfg_scale": 1.0, "negative_prompt": "blur"}, False, 1.0),
        ("qwen_image_edit", {"true_cfg_scale": 4.0, "negative_prompt": ""}, True, 4.0),
        ("qwen_image_edit", {"true_cfg_scale": 4.0, "negative_prompt": None}, False, 4.0),
        ("sana", {"guidance_scale": 4.5}, True, 4.5),
        ("sana", {"guidance_scale": 1.0}, False, 1.0),
        ("sd3", {"guidance_scale": 7.0}, True, 7.0),
        ("wan", {"guidance_scale": 1.0}, False, 1.0),
        ("hunyuan_video_15", {"guidance_scale": 0.5}, True, 0.5),
        ("hunyuan_video_15", {"guidance_scale": 1.0}, False, 1.0),
        ("z_image", {"guidance_scale": 0.5}, True, 0.5),
        ("z_image", {"guidance_scale": 0.0}, False, 0.0),
        ("flux2", {"guidance_scale": 4.0, "true_cfg_scale": 4.0, "negative_prompt": "blur"}, False, 4.0),
        ("flux2_klein", {"guidance_scale": 4.0}, True, 4.0),
    ],
)
def test_guidance_rule_is_the_diffusers_pipelines_rule(
    family: str, fields: dict[str, object], runs: bool, scale: float
) -> None:
    """The spec's guidance rule decides as the family's diffusers pipeline does (`do_classifier_free_guidance`)."""
    from types import SimpleNamespace

    from diffuserve.family_spec import spec_for

    params = SimpleNamespace(**{"guidance_scale": 3.5, "true_cfg_scale": 1.0, "negative_prompt": None, **fields})
    rule = spec_for(family).guidance
    assert rule.runs(params) is runs
    if family != "flux2":  # guidance-distilled: the scale is the transformer's input, never a CFG scale
        assert rule.scale(params) == scale
