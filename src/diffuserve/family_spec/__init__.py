"""The family vocabulary, a leaf package: every fact about every model family the product knows, torch-free.

`base.py` holds the types (`FamilySpec`, `ProfileFacts`, ...), `checkpoint.py` a checkpoint's facts from its configs,
`components.py` the layer rows shared by many families, and `<family>.py` one module per family with its `SPEC` (or
`SPECS`). This module is the registry over the specs. Nothing here imports torch or any other folder of `diffuserve`
but `errors`: `pipelines/`, `models/`, `config/`, `sampling` and the plan read it, and `diffuserve plan` and `--help`
stay fast. A family's plug-ins (its native adapter, its `make-tiny` builders) live in `diffuserve/families/<family>/`,
above the recipe; a spec names them by string (`native_adapter`, `tiny_builds`), so nothing here imports them.

Precedence between a checkpoint and `--model-id`: the folder's model_index.json `_class_name` decides the
family whenever it is a class some spec lists, because the folder is what will actually be loaded; the
`--model-id` hint only names the family of a class no spec lists (a renamed or custom pipeline class). The
registry (which backend runs it) and the deployment plan both resolve through `family_for`.
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache

from diffuserve.family_spec.base import FamilySpec, LayerRules, ProfileFacts, SamplingDefaults, StepCacheRules
from diffuserve.family_spec.components import SHARED_LAYER_RULES

__all__ = [
    "FamilySpec",
    "ProfileFacts",
    "SamplingDefaults",
    "all_specs",
    "spec_for",
    "family_for",
    "family_from_class",
    "family_from_model_id",
    "tiny_builds",
    "layer_rules",
    "step_cache_rules",
    "GENERIC",
    "families_with",
    "named_list",
    "BACKENDS",
    "backend_for",
]

BACKENDS = ("auto", "native", "diffusers")
"""`--backend` choices: auto runs the native adapter when the family has one, else the diffusers backend."""

FAMILY_MODULES: tuple[str, ...] = (
    "flux",
    "flux2",
    "qwen_image",
    "qwen_image_edit",
    "z_image",
    "sana",
    "sd3",
    "wan",
    "ltx2",
    "hunyuan_video15",
    "video_others",
    "image_others",
    "hunyuan3d",
)
"""Family modules of `diffuserve.family_spec` that define `SPECS` (a tuple) or `SPEC`; one line each."""

GENERIC = FamilySpec(name="generic")
"""Plan defaults for a checkpoint whose class no spec lists (it still runs through the diffusers backend)."""


@lru_cache(maxsize=1)
def all_specs() -> dict[str, FamilySpec]:
    """family name -> spec, over every module in FAMILY_MODULES."""
    specs: dict[str, FamilySpec] = {}
    for name in FAMILY_MODULES:
        module = importlib.import_module(f"diffuserve.family_spec.{name}")
        found = getattr(module, "SPECS", None) or (module.SPEC,)
        for spec in found:
            if spec.name in specs:
                raise RuntimeError(f"family {spec.name!r} is defined twice (family_spec/{name}.py)")
            specs[spec.name] = spec
    return specs


def spec_for(family: str) -> FamilySpec:
    """The spec of `family`; the generic spec for `generic`/`unknown`. KeyError for other names."""
    if family in ("generic", "unknown"):
        return GENERIC
    return all_specs()[family]


@lru_cache(maxsize=1)
def _class_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for spec in all_specs().values():
        for cls in spec.pipeline_classes:
            index[cls] = spec.name
    return index


def family_from_class(class_name: str) -> str | None:
    """The family of a diffusers pipeline class name, or None when no spec lists it."""
    return _class_index().get(class_name)


def family_from_model_id(model_id: str) -> str | None:
    """The family a `--model-id` hint names (e.g. "black-forest-labs/FLUX.1-dev" -> flux), or None."""
    lowered = model_id.lower()
    ordered = sorted(all_specs().values(), key=lambda s: -s.id_priority)
    for spec in ordered:
        if any(re.search(p, lowered) for p in spec.model_id_patterns):
            return spec.name
    return None


def family_for(class_name: str, model_id: str | None = None) -> str:
    """THE precedence rule (module docstring): the class when a spec lists it, else the model-id hint,
    else `unknown`."""
    return family_from_class(class_name) or (family_from_model_id(model_id) if model_id else None) or "unknown"


def _capability(spec: FamilySpec, capability: str) -> bool:
    if hasattr(spec, capability):
        return bool(getattr(spec, capability))
    if hasattr(spec.profile, capability):
        return bool(getattr(spec.profile, capability))
    raise AttributeError(f"no family spec field or profile fact is named {capability!r}")


def families_with(capability: str) -> list[str]:
    """Names of the families whose spec says `capability` (a FamilySpec field or property such as
    `supports_continuous` / `has_native`, or a ProfileFacts field such as `sequence_parallel`), sorted: every
    list of families in an error message or in `--help` is generated here."""
    return sorted(name for name, spec in all_specs().items() if _capability(spec, capability))


def named_list(names: list[str]) -> str:
    """ "a, b and c" (for error messages)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}" if names else "none"


def backend_for(family: str, backend: str) -> str:
    """native | diffusers: the backend that runs `family` under `--backend auto|native|diffusers` (the plan and
    the loader both ask here)."""
    from diffuserve.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r} is not one of {list(BACKENDS)}.", param="backend")
    if backend == "diffusers":
        return "diffusers"
    native = families_with("has_native")
    has_native = family in native
    if backend == "native" and not has_native:
        raise ConfigError(
            f"--backend native: family {family!r} has no native adapter (native families: "
            f"{native}); use --backend auto or --backend diffusers.",
            param="backend",
        )
    return "native" if has_native else "diffusers"


def tiny_builds() -> dict[str, str]:
    """`make-tiny --family` name -> "module:function", over every spec."""
    builds: dict[str, str] = {}
    for spec in all_specs().values():
        builds.update(spec.tiny_builds)
    return builds


def family_of_tiny(name: str) -> str:
    """The family whose spec builds the tiny checkpoint `name`."""
    for spec in all_specs().values():
        if name in spec.tiny_builds:
            return spec.name
    raise KeyError(name)


@lru_cache(maxsize=1)
def layer_rules() -> LayerRules:
    """The one layer table: shared encoder/VAE classes plus every family's own classes."""
    rules: LayerRules = dict(SHARED_LAYER_RULES)
    for spec in all_specs().values():
        rules.update(spec.layer_containers)
    return rules


@lru_cache(maxsize=1)
def step_cache_rules() -> dict[str, StepCacheRules]:
    """DiT class name -> its step-cache rules, from every family's spec."""
    rules: dict[str, StepCacheRules] = {}
    for spec in all_specs().values():
        rules.update(spec.step_cache_rules)
    return rules
