"""Which residency each component was given explicitly: `--component-residency` selectors (a component's key,
its group, `all`, or `video_vae`; the later of two selectors naming the same target wins) and the legacy
per-component flags, with did-you-mean errors that name the flag. Pure; `config/deployment.py` resolves the rest
from the mode.

`video_vae` is the seed's spelling of a video family's VAE (`--layerwise-resident-layers video_vae=36`): on a video
model it names the `vae` component, as its key would (a video family's `vae` is its video VAE; LTX-2's audio VAE is
`audio_vae`); on an image model it is an error naming the flag rather than a silent no-op."""

from __future__ import annotations

import difflib

from diffuserve.config.deployment_args import RESIDENCY_MODES, DeploymentArgs, flag_name, flag_param
from diffuserve.config.model_profiles import GROUPS, ModelProfile
from diffuserve.config.plan import ResidencyMode
from diffuserve.errors import ConfigError


# --- selectors -------------------------------------------------------------------------------------------
def _closest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def split_selector(flag: str, item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise ConfigError(f"{flag} expects NAME=VALUE items, got {item!r}.", param=flag_param(flag))
    return name.strip(), value.strip()


VIDEO_VAE = "video_vae"
"""The selector naming a video family's VAE (the seed's spelling); the component it names is `VIDEO_VAE_KEY`."""
VIDEO_VAE_KEY = "vae"


def _video_vae(flag: str, profile: ModelProfile) -> list[str]:
    """The component `video_vae` names: the video model's `vae`; an image model has none (an error, not a no-op)."""
    if profile.kind != "video":
        raise ConfigError(
            f"{flag}: {VIDEO_VAE!r} selects a video model's VAE, but this model ({profile.family}) makes "
            f"{profile.kind}s and has no video VAE; name its VAE as {VIDEO_VAE_KEY!r} (or the group 'vae'). "
            f"{describe_selectors(profile)}",
            param=flag_param(flag),
        )
    if VIDEO_VAE_KEY not in profile.components:
        raise ConfigError(
            f"{flag}: {VIDEO_VAE!r} names the {VIDEO_VAE_KEY!r} component, which this checkpoint lacks. "
            f"{describe_selectors(profile)}",
            param=flag_param(flag),
        )
    return [VIDEO_VAE_KEY]


def _targets(flag: str, name: str, profile: ModelProfile) -> tuple[list[str], int]:
    """Components a selector name covers and its specificity (key or video_vae 2 > group 1 > all 0)."""
    if name == "all":
        return list(profile.components), 0
    if name in GROUPS:
        return profile.group_members(name), 1
    if name in profile.components:
        return [name], 2
    if name == VIDEO_VAE:
        return _video_vae(flag, profile), 2
    video = [VIDEO_VAE] if profile.kind == "video" else []
    options = list(dict.fromkeys([*profile.components, *GROUPS, "all", *video]))
    raise ConfigError(
        f"{flag}: unknown component or group {name!r}.{_closest(name, options)} {describe_selectors(profile)}",
        param=flag_param(flag),
    )


def describe_selectors(profile: ModelProfile) -> str:
    """What a selector may name on this model: each component once, then each group with what it covers."""

    def covers(group: str) -> str:
        members = profile.group_members(group)
        return ", ".join(members) if members else "none in this model"

    groups = [f"{group} ({covers(group)})" for group in GROUPS]
    video = f"; {VIDEO_VAE} ({VIDEO_VAE_KEY})" if profile.kind == "video" else ""
    return (
        f"This model's components: {', '.join(profile.components)}. Groups: {'; '.join(groups)}; all (every "
        f"component){video}."
    )


def select_targets(flag: str, items: list[tuple[str, str]], profile: ModelProfile) -> dict[str, tuple[str, str]]:
    """component -> (value, the item that set it), most specific selector winning, later on ties."""
    chosen: dict[str, tuple[int, str, str]] = {}
    for name, value in items:
        comps, rank = _targets(flag, name, profile)
        for comp in comps:
            if comp not in chosen or rank >= chosen[comp][0]:
                chosen[comp] = (rank, value, f"{flag} {name}={value}")
    return {comp: (value, source) for comp, (_, value, source) in chosen.items()}


def choose(flag: str, value: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(
            f"{flag}: {value!r} is not one of {', '.join(options)}.{_closest(value, list(options))}",
            param=flag_param(flag),
        )
    return value


# --- residency ------------------------------------------------------------------------------------------
_LEGACY_OFFLOAD = {
    "dit": "dit_cpu_offload",
    "text_encoder": "text_encoder_cpu_offload",
    "image_encoder": "image_encoder_cpu_offload",
    "vae": "vae_cpu_offload",
}


def explicit_residency(args: DeploymentArgs, profile: ModelProfile) -> dict[str, tuple[ResidencyMode, str]]:
    """Residency set by the user (selectors, then legacy flags): component -> (mode, flag text)."""
    flag = "--component-residency"
    items = [split_selector(flag, item) for item in args.component_residency]
    selected = {
        c: (ResidencyMode(choose(flag, v, RESIDENCY_MODES)), src)
        for c, (v, src) in select_targets(flag, items, profile).items()
    }
    layerwise_list: set[str] = set()
    for name in filter(None, (n.strip() for n in (args.layerwise_offload_components or "").split(","))):
        layerwise_list.update(_targets("--layerwise-offload-components", name, profile)[0])
    explicit: dict[str, tuple[ResidencyMode, str]] = {}
    for name, comp in profile.components.items():
        legacy_offload = _LEGACY_OFFLOAD.get(comp.group)
        offload = getattr(args, legacy_offload) if legacy_offload else None
        if name in selected:
            explicit[name] = selected[name]
        elif comp.group == "dit" and args.dit_layerwise_offload:
            explicit[name] = (ResidencyMode.LAYERWISE_OFFLOAD, "--dit-layerwise-offload")
        elif name in layerwise_list:
            if comp.group == "dit" and args.dit_layerwise_offload is False:
                raise ConfigError(
                    f"--layerwise-offload-components names {name} but --dit-layerwise-offload is false; drop one of "
                    "them.",
                    param="layerwise_offload_components",
                )
            explicit[name] = (ResidencyMode.LAYERWISE_OFFLOAD, "--layerwise-offload-components")
        elif offload is not None:
            mode = ResidencyMode.COMPONENT_OFFLOAD if offload else ResidencyMode.RESIDENT
            explicit[name] = (mode, f"{flag_name(legacy_offload)} {str(offload).lower()}")  # type: ignore[arg-type]
    return explicit
