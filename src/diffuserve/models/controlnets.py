"""ControlNet checkpoints beside the base model (`--controlnet`): the family check, their plan components and
their loading. Reads JSON and safetensors headers for the plan (no torch), diffusers' model classes to load.

A ControlNet belongs to the family whose spec lists its class (`FamilySpec.controlnet_classes`); one for another
family than the base model's is refused at start-up (exit 2), naming the flag and both families.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from diffuserve.config.controlnet import FLAG, ControlNetEntry, parse_controlnets
from diffuserve.errors import ConfigError
from diffuserve.pipelines.controlnet import LoadedControlNet

if TYPE_CHECKING:
    from diffuserve.pipelines.base import Pipeline


def controlnet_class(entry: ControlNetEntry) -> str:
    """The model class its config.json names (`_class_name`)."""
    try:
        config = json.loads((entry.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{FLAG}: {entry.path / 'config.json'} cannot be read ({exc}).", param="controlnet") from exc
    return str(config.get("_class_name", ""))


def family_of_class(class_name: str) -> str | None:
    """The family whose spec lists this ControlNet class; None when none does."""
    from diffuserve import family_spec

    return next((s.name for s in family_spec.all_specs().values() if class_name in s.controlnet_classes), None)


def check_families(entries: list[ControlNetEntry], base_family: str) -> list[str]:
    """Each entry's class, after checking it is a ControlNet of `base_family`; ConfigError (exit 2) otherwise."""
    from diffuserve import family_spec

    spec = family_spec.spec_for(base_family) if base_family in family_spec.all_specs() else None
    # A variant (qwen_image_edit) shares nothing here: the base family's own list decides.
    takes = spec.controlnet_classes if spec is not None else ()
    takers = sorted(s.name for s in family_spec.all_specs().values() if s.controlnet_classes)
    classes = []
    for entry in entries:
        cls = controlnet_class(entry)
        family = family_of_class(cls)
        if family is None:
            raise ConfigError(
                f"{FLAG}: {entry.name} ({entry.path}) is a {cls or 'model without _class_name'}, not a ControlNet "
                f"diffuserve runs; ControlNets are served for {', '.join(takers)}.",
                param="controlnet",
            )
        if cls not in takes:
            wants = (
                f"its ControlNets are {', '.join(takes)}"
                if takes
                else f"ControlNets are served for {', '.join(takers)}"
            )
            raise ConfigError(
                f"{FLAG}: {entry.name} ({entry.path}) is a {cls}, a ControlNet for the {family} family, but the base "
                f"model at --model-path is a {base_family} model ({wants}). Give a ControlNet trained for "
                f"{base_family}, or serve a {family} base model.",
                param="controlnet",
            )
        classes.append(cls)
    return classes


def with_controlnets(profile: Any, specs: list[str], load_dtype: str | None) -> Any:
    """`profile` (ModelProfile) with one component per ControlNet (`controlnet`, `controlnet_2`, ...) counted from
    its safetensors headers, after the family check: the plan gives them residency and counts their bytes."""
    from diffuserve.config.model_profiles import component_profile

    entries = parse_controlnets(specs)
    classes = check_families(entries, profile.family)
    components = dict(profile.components)
    for entry, cls in zip(entries, classes, strict=True):
        components[entry.key] = component_profile(entry.key, cls, entry.path, load_dtype)
    return profile.with_components(components)


def check_parallel(plan: Any) -> None:
    """Refuse the parallel modes that split a denoiser call over ranks: the ControlNet rows are not split with it
    (replicas, `--dp-size`, keep whole calls and do work)."""
    flags = [
        flag
        for flag, on in (
            ("--tp-size", plan.tp_size > 1),
            ("--ulysses-degree / --ring-degree", plan.sp_degree > 1),
            ("--use-fsdp-inference", plan.use_fsdp_inference),
            ("--enable-cfg-parallel", plan.enable_cfg_parallel),
        )
        if on
    ]
    if flags:
        raise ConfigError(
            f"{FLAG} with {' and '.join(flags)}: ControlNet rows run on one rank per replica (their residuals are not "
            "split over ranks yet). Drop the flag (pass --use-fsdp-inference false / --enable-cfg-parallel false "
            "where the performance mode chose it); replicas (--dp-size) work.",
            param="controlnet",
        )


def load_controlnets(specs: list[str], family: str, *, dtype: Any) -> list[LoadedControlNet]:
    """Load each `--controlnet` folder to the host with its diffusers class (residency moves it as planned)."""
    import diffusers

    entries = parse_controlnets(specs)
    classes = check_families(entries, family)
    loaded = []
    for entry, cls in zip(entries, classes, strict=True):
        model = getattr(diffusers, cls).from_pretrained(str(entry.path), torch_dtype=dtype).eval()
        model.requires_grad_(False)
        loaded.append(LoadedControlNet(name=entry.name, key=entry.key, model=model, class_name=cls))
    return loaded


def install_controlnets(pipeline: Pipeline, specs: list[str]) -> None:
    """`--controlnet`: load each ControlNet (family-checked) and hand them to `pipeline` (`Pipeline.use_controlnets`,
    which makes each a component). A pipeline that runs none (`supports_controlnet` False: the diffusers backend,
    a family without ControlNets) is refused there, naming the flag, before any weight is read."""
    loaded = load_controlnets(specs, pipeline.family, dtype=pipeline.dtype) if pipeline.supports_controlnet else []
    pipeline.use_controlnets(loaded)
