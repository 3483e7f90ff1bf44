"""Every native family adapter against the `FamilyAdapter` protocol (`pipelines/adapter.py`).

An adapter is no pipeline: it inherits nothing of the recipe (`RecipePipeline` drives it, composed), only the data
base `AdapterBase` whose methods are binding helpers. Each adapter implements the protocol's required parts with their
signatures (parameter names included: the recipe calls some by keyword) and may implement its optional parts.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from diffuserve.models import registry
from diffuserve.pipelines.adapter import OPTIONAL, REQUIRED, AdapterBase, FamilyAdapter, OptionalParts
from diffuserve.pipelines.base import Pipeline
from diffuserve.pipelines.recipe import RecipePipeline

OWN_LOOP = {"hunyuan3d"}
"""Native families that run their own loop (meshes) as a `Pipeline`, not as a recipe adapter."""
ADAPTER_BASE_METHODS = {"from_components", "bind_parts", "bind_facts", "component", "size_multiple"}
"""What an adapter inherits beyond data: loading helpers. Growing this list means the recipe leaks into adapters."""

FAMILIES = sorted(registry.native_families())
ADAPTERS = [family for family in FAMILIES if family not in OWN_LOOP]


def _adapter_class(family: str) -> type:
    module_name, _, class_name = registry.native_families()[family].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _methods(cls: type) -> set[str]:
    """The methods and properties `cls` defines itself (not its bases)."""
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("__") and (inspect.isfunction(value) or isinstance(value, (property, classmethod)))
    }


def _defined(cls: type, name: str) -> bool:
    """`cls` (or a family class under it, not `AdapterBase`) defines method `name`."""
    return any(name in _methods(klass) for klass in cls.__mro__ if klass not in (AdapterBase, object))


def _parameters(function: object) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]  # type: ignore[arg-type]


def test_the_own_loop_families_are_pipelines_and_the_rest_adapters() -> None:
    for family in FAMILIES:
        cls = _adapter_class(family)
        if family in OWN_LOOP:
            assert issubclass(cls, Pipeline), family
        else:
            assert issubclass(cls, AdapterBase), f"{family}: {cls.__name__} is no AdapterBase"


def test_adapter_base_holds_data_and_binding_only() -> None:
    """The base an adapter inherits has no behaviour of the recipe: its methods are the loading helpers."""
    assert _methods(AdapterBase) == ADAPTER_BASE_METHODS
    assert AdapterBase.__mro__ == (AdapterBase, object)


@pytest.mark.parametrize("family", ADAPTERS)
def test_adapter_inherits_nothing_of_the_recipe(family: str) -> None:
    cls = _adapter_class(family)
    assert not issubclass(cls, Pipeline), f"{family}: {cls.__name__} is a pipeline; the recipe drives adapters"
    shared = (set(cls.__mro__) & set(RecipePipeline.__mro__)) - {object}
    assert not shared, f"{family}: {cls.__name__} inherits {shared} of the recipe"


@pytest.mark.parametrize("family", ADAPTERS)
def test_adapter_implements_the_protocol_parts(family: str) -> None:
    cls = _adapter_class(family)
    for name in REQUIRED:
        assert _defined(cls, name), f"{family}: {cls.__name__} does not implement {name}"
        assert _parameters(getattr(cls, name)) == _parameters(getattr(FamilyAdapter, name)), (
            f"{family}: {cls.__name__}.{name} takes other parameters than FamilyAdapter.{name}"
        )
    for name in OPTIONAL:
        if _defined(cls, name):
            assert _parameters(getattr(cls, name)) == _parameters(getattr(OptionalParts, name)), (
                f"{family}: {cls.__name__}.{name} takes other parameters than OptionalParts.{name}"
            )
    for field in ("family", "denoisers", "decoder", "masked_sequences"):
        assert hasattr(cls, field), f"{family}: {cls.__name__} lacks the protocol's {field}"


def test_recipe_runs_every_protocol_part() -> None:
    """The protocol names the recipe's parts: every part it declares is one the recipe calls (with its default)."""
    for name in (*REQUIRED, *OPTIONAL):
        assert _parameters(getattr(RecipePipeline, name)) == _parameters(
            getattr(FamilyAdapter if name in REQUIRED else OptionalParts, name)
        ), name


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


class _ToyAdapter(AdapterBase):
    """An adapter written from the protocol alone: the four required parts, no optional one."""

    family = "sana"  # its spec: one text encoder, CFG when guidance_scale > 1

    def __init__(self) -> None:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        super().__init__()
        self.scheduler = FlowMatchEulerDiscreteScheduler()
        self.bind_facts({})
        self.dtype = torch.float64

    def encode_text(self, key, texts, batch):
        import torch

        return {"embeds": torch.tensor([[float(len(t))] for t in texts], dtype=self.dtype)}

    def prepare(self, batch, head, positive):
        from diffuserve.pipelines import recipe

        scheduler = recipe.fresh_scheduler(self.scheduler)
        scheduler.set_timesteps(head.num_inference_steps)
        latents = recipe.batch_noise(batch, (3,), device=self.device, dtype=self.dtype)
        return recipe.DenoiseState(latents, scheduler.timesteps, scheduler, {})

    def predict(self, latents, timestep, cond, state, model_key):
        return 0.5 * latents + cond["embeds"] * (timestep[:, None] / 1000)

    def decode(self, latents, state):
        return [row.clone() for row in latents]


@pytest.mark.parametrize("batched_cfg", [True, False])
def test_a_protocol_only_adapter_runs_on_the_recipe_as_the_cfg_loop_written_out(batched_cfg: bool) -> None:
    """The recipe drives an adapter of the four required parts with its own defaults (classic CFG combine, the
    scheduler's step, the only denoiser, preview = decode): equal to the CFG loop written out by hand, within
    float64 rounding (1e-12), for CFG as one doubled batch and as two passes."""
    import torch

    from diffuserve.pipelines import recipe
    from diffuserve.sampling import SamplingParams

    adapter = _ToyAdapter()
    pipe = RecipePipeline(adapter)
    pipe.batched_cfg = batched_cfg
    assert adapter.recipe is pipe and pipe.family == "sana" and pipe.output_kind == "image"
    batch = [
        SamplingParams(prompt="a fox", negative_prompt="blur", guidance_scale=4.0, num_inference_steps=4, seed=3, n=2),
        SamplingParams(prompt="a red kite", negative_prompt="blur", guidance_scale=4.0, num_inference_steps=4, seed=9),
    ]
    previews: list[object] = []
    result = pipe.run(batch, on_preview=lambda i, n, make: previews.append(make()))

    latents = recipe.batch_noise(batch, (3,), device=adapter.device, dtype=torch.float64)
    scheduler = recipe.fresh_scheduler(adapter.scheduler)
    scheduler.set_timesteps(4)
    positive = torch.tensor([[5.0], [5.0], [10.0]], dtype=torch.float64)
    negative = torch.full((3, 1), 4.0, dtype=torch.float64)
    for t in scheduler.timesteps:
        cond = 0.5 * latents + positive * (t / 1000)
        uncond = 0.5 * latents + negative * (t / 1000)
        latents = scheduler.step(uncond + 4.0 * (cond - uncond), t, latents, return_dict=False)[0]
    ours = torch.stack([row for output in result.outputs for row in output.images])
    assert [len(output.images) for output in result.outputs] == [2, 1]
    assert torch.allclose(ours, latents, rtol=0, atol=1e-12)
    assert len(previews) == 4  # one preview per step, through the default preview (the adapter's decode)
