"""The deployment flags and `resolve(args, hardware, profile) -> DeploymentPlan`, the performance modes.

Pure: no torch, no I/O. Every field of `DeploymentArgs` is None when the user did not set it, which
is how "explicit flags always beat the mode" is kept: a mode only fills fields that are still None.

Residency precedence for one component, first match wins:
  1. `--component-residency` selectors; among them the component's own key beats its group
     (`dit`, `text_encoder`, `image_encoder`, `vae`, `other`), which beats `all`; the later of two
     selectors naming the same target wins. A name that is a group (`text_encoder`, `vae`) means the
     group, so `text_encoder=...` covers `text_encoder_2` too; address the others by their own key.
  2. legacy flags for that component: `--dit-layerwise-offload` / `--layerwise-offload-components`
     (layer-wise), then `--dit-cpu-offload` and friends (true: component-offload, false: resident).
  3. the performance mode's default.
A selector thus overrides only the legacy setting of the components it names; other legacy flags and
mode defaults stay in force.

Decisions of ours where the seed is silent (each shows up in `plan.trace`):
  - No accelerator (`device_kind == "cpu"`): `auto` makes everything resident, because host memory is
    the device memory and offloading would only add copies. Explicit choices and `memory` still run
    offload for real on the CPU, so nothing is rejected for being on a CPU host.
  - Any offload of a DiT that FSDP shards is refused when both are explicit, snapshot-offload included:
    FSDP replaces DiT offload, and a host snapshot of one rank's shard is not the component.
  - `--layerwise-resident-layers` / lifetimes aimed at a component that did not end up layer-wise are
    ignored with a trace line, so one config file works on big and small GPUs alike.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from diffuserve import families
from diffuserve.config.model_profiles import GROUPS, ComponentProfile, ModelProfile
from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime, ResidencyMode
from diffuserve.errors import ConfigError
from diffuserve.hardware import GIB, HardwareInfo

PERFORMANCE_MODES = ("manual", "auto", "speed", "memory")
RESIDENCY_MODES = tuple(m.value for m in ResidencyMode)
LIFETIMES = tuple(lt.value for lt in Lifetime)
_MODE_G = "Deployment: performance mode and residency"
_LAYER_G = "Deployment: layer-wise offload"
_COMPILE_G = "Deployment: compile and CUDA graphs"
_PAR_G = "Deployment: GPUs and parallelism"


def _f(help: str, group: str, default: Any = None, **meta: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=list, metadata={"help": help, "group": group, **meta})
    return field(default=default, metadata={"help": help, "group": group, **meta})


@dataclass
class DeploymentArgs:
    """Every deployment flag; None (or an empty list) means "not set", so the mode may fill it."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate", "plan")
    """Every deployment flag is taken by `serve`, `generate` and `plan` (see argparse_dataclass.py)."""

    performance_mode: str = _f("Preset: manual, auto, speed or memory. Explicit flags always win.", _MODE_G, "auto", choices=list(PERFORMANCE_MODES), aliases=["--mode"])
    """manual | auto | speed | memory."""
    component_residency: list[str] = _f("COMPONENT=MODE selectors; COMPONENT is a model_index.json key or dit, text_encoder, image_encoder, vae, all; MODE is resident, component-offload, snapshot-offload or layerwise-offload.", _MODE_G, [], nargs="+", metavar="COMPONENT=MODE")
    """Canonical residency selectors (override only the legacy flags of the components they name)."""
    dit_cpu_offload: bool | None = _f("Legacy: offload the DiT between uses (component offload).", _MODE_G)
    """Legacy DiT offload switch."""
    text_encoder_cpu_offload: bool | None = _f("Legacy: offload the text encoders between uses.", _MODE_G)
    """Legacy text-encoder offload switch."""
    image_encoder_cpu_offload: bool | None = _f("Legacy: offload the image encoder between uses.", _MODE_G)
    """Legacy image-encoder offload switch."""
    vae_cpu_offload: bool | None = _f("Legacy: offload the VAE between uses.", _MODE_G)
    """Legacy VAE offload switch."""
    dit_layerwise_offload: bool | None = _f("Legacy: stream the DiT layer by layer.", _LAYER_G)
    """Legacy DiT layer-wise switch."""
    layerwise_offload_components: str | None = _f("Legacy: comma list of components or groups to stream layer by layer (e.g. dit,text_encoder,vae).", _LAYER_G, metavar="LIST")
    """Comma list of keys/groups made layer-wise."""
    layerwise_resident_layers: list[str] = _f("COMP=N: keep N layers (a count, or a ratio 0<r<1) of a layer-wise component on the device.", _LAYER_G, [], nargs="+", metavar="COMP=N")
    """Resident layer sets of layer-wise components."""
    layerwise_residency_lifetime: list[str] = _f("COMP=forward|permanent: forward places the resident set per run; permanent places it at load (must fit).", _LAYER_G, [], nargs="+", metavar="COMP=LIFETIME")
    """Lifetime of each resident layer set."""
    dit_layerwise_residency_lifetime: str | None = _f("Legacy: lifetime of the DiT's resident layer set.", _LAYER_G, choices=list(LIFETIMES))
    """forward | permanent for the DiT (a canonical selector for the same component wins)."""
    dit_offload_prefetch_size: int | None = _f("Layers in flight ahead of the computing one when streaming (0 means 1; default 1).", _LAYER_G, metavar="N")
    """Prefetch depth of layer-wise streaming."""
    pin_cpu_memory: bool | None = _f("Keep host copies of offloaded weights in pinned memory (CUDA only; default on with CUDA).", _LAYER_G)
    """Pinned host copies (ignored without CUDA)."""
    enable_torch_compile: bool | None = _f("torch.compile the DiT (default off unless the family has a validated compile path).", _COMPILE_G)
    """torch.compile switch."""
    offload_during_compile: bool | None = _f("Offload the DiT and evict other components during compile warm-up (default on).", _COMPILE_G)
    """Offload while compiling so max-autotune fits tighter GPUs."""
    enable_breakable_cuda_graph: bool | None = _f("Capture breakable CUDA graphs for image pipelines (CUDA only; needs --warmup-resolutions).", _COMPILE_G)
    """Breakable CUDA graph switch."""
    warmup_resolutions: list[str] = _f("Serving resolutions to warm up / capture, as WxH (e.g. 1024x1024).", _COMPILE_G, [], nargs="+", metavar="WxH")
    """Resolutions warmed up at start-up."""
    num_gpus: int | None = _f("GPUs (or ranks on a CPU host) to deploy on (default 1).", _PAR_G, metavar="N")
    """Number of selected devices; the smallest free memory among them decides."""
    use_fsdp_inference: bool | None = _f("Shard the DiT over the GPUs with FSDP (auto turns it on only where it replaces DiT offload).", _PAR_G)
    """FSDP switch."""
    enable_cfg_parallel: bool | None = _f("Split the positive/negative CFG branches over two GPUs.", _PAR_G)
    """CFG parallel switch."""
    ulysses_degree: int | None = _f("Ulysses sequence-parallel degree: attention heads split over this many ranks, tokens exchanged all-to-all (default 1).", _PAR_G, metavar="N")
    """Ulysses degree (must divide the DiT's attention heads)."""
    ring_degree: int | None = _f("Ring sequence-parallel degree: key/value blocks passed around this many ranks (default 1).", _PAR_G, metavar="N")
    """Ring-attention degree."""
    sp_degree: int | None = _f("Sequence-parallel degree = --ulysses-degree x --ring-degree; given alone it runs as Ulysses (default 1).", _PAR_G, metavar="N")
    """Total sequence-parallel degree."""
    tp_size: int | None = _f("Tensor-parallel degree: the DiT's attention heads and MLPs split over this many ranks (default 1).", _PAR_G, metavar="N", aliases=["--tp-degree"])
    """Tensor-parallel degree (`--tp-degree` is the older name)."""
    dp_size: int | None = _f("Data-parallel replicas: --num-gpus is split into this many replicas of num_gpus/dp ranks behind the one endpoint; each batch goes to the least-loaded replica (default: 1, or the ranks no parallel degree uses).", _PAR_G, metavar="N")
    """Data-parallel replicas."""


# --- selectors -------------------------------------------------------------------------------------------
def _closest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _split(flag: str, item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise ConfigError(f"{flag} expects NAME=VALUE items, got {item!r}.", param=_param(flag))
    return name.strip(), value.strip()


def _targets(flag: str, name: str, profile: ModelProfile) -> tuple[list[str], int]:
    """Components a selector name covers and its specificity (key 2 > group 1 > all 0)."""
    if name == "all":
        return list(profile.components), 0
    if name in GROUPS:
        return profile.group_members(name), 1
    if name in profile.components:
        return [name], 2
    options = list(dict.fromkeys([*profile.components, *GROUPS, "all"]))
    raise ConfigError(
        f"{flag}: unknown component or group {name!r}.{_closest(name, options)} {describe_selectors(profile)}",
        param=_param(flag),
    )


def describe_selectors(profile: ModelProfile) -> str:
    """What a selector may name on this model: each component once, then each group with what it covers."""
    def covers(group: str) -> str:
        members = profile.group_members(group)
        return ", ".join(members) if members else "none in this model"

    groups = [f"{group} ({covers(group)})" for group in GROUPS]
    return (f"This model's components: {', '.join(profile.components)}. "
            f"Groups: {'; '.join(groups)}; all (every component).")


def _select(flag: str, items: list[tuple[str, str]], profile: ModelProfile) -> dict[str, tuple[str, str]]:
    """component -> (value, the item that set it), most specific selector winning, later on ties."""
    chosen: dict[str, tuple[int, str, str]] = {}
    for name, value in items:
        comps, rank = _targets(flag, name, profile)
        for comp in comps:
            if comp not in chosen or rank >= chosen[comp][0]:
                chosen[comp] = (rank, value, f"{flag} {name}={value}")
    return {comp: (value, source) for comp, (_, value, source) in chosen.items()}


def _choice(flag: str, value: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"{flag}: {value!r} is not one of {', '.join(options)}.{_closest(value, list(options))}", param=_param(flag))
    return value


# --- residency ------------------------------------------------------------------------------------------
_LEGACY_OFFLOAD = {
    "dit": "dit_cpu_offload",
    "text_encoder": "text_encoder_cpu_offload",
    "image_encoder": "image_encoder_cpu_offload",
    "vae": "vae_cpu_offload",
}


def _param(flag: str) -> str:
    """ConfigError.param is the field name (`component_residency`), as in the rest of the config errors."""
    return flag.split()[0].lstrip("-").replace("-", "_")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _explicit_residency(args: DeploymentArgs, profile: ModelProfile) -> dict[str, tuple[ResidencyMode, str]]:
    """Residency set by the user (selectors, then legacy flags): component -> (mode, flag text)."""
    flag = "--component-residency"
    items = [_split(flag, item) for item in args.component_residency]
    selected = {c: (ResidencyMode(_choice(flag, v, RESIDENCY_MODES)), src) for c, (v, src) in _select(flag, items, profile).items()}
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
                    f"--layerwise-offload-components names {name} but --dit-layerwise-offload is false; drop one of them.",
                    param="layerwise_offload_components",
                )
            explicit[name] = (ResidencyMode.LAYERWISE_OFFLOAD, "--layerwise-offload-components")
        elif offload is not None:
            mode = ResidencyMode.COMPONENT_OFFLOAD if offload else ResidencyMode.RESIDENT
            explicit[name] = (mode, f"{_flag(legacy_offload)} {str(offload).lower()}")  # type: ignore[arg-type]
    return explicit


@dataclass
class _Ctx:
    mode: str
    min_free: int
    num_gpus: int
    accelerator: bool


def _layerwise_or_offload(comp: ComponentProfile, allowed: bool) -> ResidencyMode:
    return ResidencyMode.LAYERWISE_OFFLOAD if allowed and comp.has_layers else ResidencyMode.COMPONENT_OFFLOAD


def _mode_default(comp: ComponentProfile, profile: ModelProfile, ctx: _Ctx, dit_resident: bool) -> tuple[ResidencyMode, str]:
    """The performance mode's choice for a component the user left alone, and the rule that made it."""
    free_gib = ctx.min_free / GIB
    where = f"min free {free_gib:.1f} GiB over {ctx.num_gpus} GPU{'s' if ctx.num_gpus > 1 else ''}"
    large = comp.param_bytes >= profile.large_encoder_gib * GIB
    if ctx.mode in ("manual", "speed"):
        return ResidencyMode.RESIDENT, f"{ctx.mode}: unset -> resident"
    if ctx.mode == "memory":
        if comp.group == "dit":
            return _layerwise_or_offload(comp, profile.dit_supports_layerwise), "memory: DiT offloaded, layer-wise where the family supports it"
        if comp.group in ("text_encoder", "image_encoder"):
            return _layerwise_or_offload(comp, large), "memory: encoder offloaded, layer-wise when large and layered"
        return _layerwise_or_offload(comp, True), "memory: in the default layer-wise set, component offload when it declares no layers"
    if not ctx.accelerator:
        return ResidencyMode.RESIDENT, "auto: no accelerator, host memory is the device memory -> resident"
    if comp.group == "dit":
        threshold = profile.dit_resident_threshold_gib
        if threshold is None:
            rule = f"auto: {profile.kind} family {profile.family} keeps DiT residency per model (no auto threshold)"
        elif free_gib >= threshold:
            return ResidencyMode.RESIDENT, f"auto: {where} >= {threshold:g} GiB -> resident"
        else:
            rule = f"auto: {where} < {threshold:g} GiB"
        fits = comp.param_bytes <= profile.comfortable_fit_fraction * ctx.min_free
        mode = _layerwise_or_offload(comp, profile.dit_supports_layerwise and not fits)
        return mode, f"{rule}; DiT {'fits' if fits else 'does not fit'} comfortably -> {mode.value}"
    if comp.group in ("text_encoder", "image_encoder"):
        if dit_resident and large and comp.has_layers:
            return ResidencyMode.LAYERWISE_OFFLOAD, f"auto: DiT resident and encoder >= {profile.large_encoder_gib:g} GiB (large) -> layerwise-offload"
        # Small encoders: offloading one saves little memory but costs a host->GPU copy on every request, so it
        # stays on the GPU when the DiT does and the whole model fits comfortably (docs/deployment.md states it).
        total = sum(c.param_bytes for c in profile.components.values())
        budget = profile.comfortable_fit_fraction * ctx.min_free
        whole = (f"whole model {total / GIB:.1f} GiB vs {profile.comfortable_fit_fraction:g} x {where} "
                 f"= {budget / GIB:.1f} GiB")
        if not large and dit_resident and total <= budget:
            return ResidencyMode.RESIDENT, (f"auto: small encoder (< {profile.large_encoder_gib:g} GiB), DiT resident "
                                            f"and the {whole} fits -> resident")
        why = ("large encoder" if large else "DiT offloaded" if not dit_resident
               else f"the {whole} does not fit")
        return ResidencyMode.COMPONENT_OFFLOAD, f"auto: {why} -> component-offload (on the GPU only while it runs)"
    threshold = profile.vae_resident_threshold_gib
    if free_gib >= threshold:
        return ResidencyMode.RESIDENT, f"auto: {where} >= the VAE residency threshold {threshold:g} GiB -> resident"
    return ResidencyMode.COMPONENT_OFFLOAD, f"auto: {where} < the VAE residency threshold {threshold:g} GiB -> component-offload"


# --- helpers for the numeric knobs ----------------------------------------------------------------------
def _positive(flag: str, value: int | None, default: int = 1) -> int:
    if value is None:
        return default
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1, got {value}.", param=_param(flag))
    return value


def _parse_count(source: str, text: str) -> int | float:
    """`N` (a layer count) or `0.r` (a ratio strictly between 0 and 1) of `--layerwise-resident-layers`."""
    try:
        number = float(text) if "." in text else int(text)
    except ValueError:
        raise ConfigError(f"{source}: N must be a layer count or a ratio 0<r<1.", param="layerwise_resident_layers") from None
    if isinstance(number, float) and not 0 < number < 1:
        raise ConfigError(f"{source}: a ratio must lie strictly between 0 and 1.", param="layerwise_resident_layers")
    if number < 0:
        raise ConfigError(f"{source}: a layer count cannot be negative.", param="layerwise_resident_layers")
    return number


def _resident_count(source: str, text: str, comp: ComponentProfile) -> int:
    number = _parse_count(source, text)
    if isinstance(number, float):
        return round(number * comp.num_layers)
    if number > comp.num_layers:
        raise ConfigError(f"{source}: {comp.name} has {comp.num_layers} layers.", param="layerwise_resident_layers")
    return number


_RESOLUTION = re.compile(r"^(\d+)[xX](\d+)$")


def _resolutions(items: list[str]) -> list[str]:
    out = []
    for item in items:
        match = _RESOLUTION.match(item.strip())
        if not match or int(match.group(1)) == 0 or int(match.group(2)) == 0:
            raise ConfigError(f"--warmup-resolutions: {item!r} is not WxH (e.g. 1024x1024).", param="warmup_resolutions")
        out.append(f"{int(match.group(1))}x{int(match.group(2))}")
    return out


# --- the resolver ---------------------------------------------------------------------------------------
def resolve(args: DeploymentArgs, hardware: HardwareInfo, profile: ModelProfile, *, hosts: int = 1) -> DeploymentPlan:
    """Turn flags + hardware + model profile into a DeploymentPlan; every choice leaves a trace line.

    `hardware` is this host's; `hosts` (--nnodes) spreads --num-gpus over that many hosts like it."""
    mode = _choice("--performance-mode", args.performance_mode, PERFORMANCE_MODES)
    plan = DeploymentPlan(performance_mode=mode)
    trace = plan.trace.append
    accelerator = hardware.device_kind != "cpu"

    # 1. Devices: the smallest free memory among the selected ones is the bottleneck.
    num_gpus = _positive("--num-gpus", args.num_gpus)
    if num_gpus % hosts:
        raise ConfigError(f"--num-gpus {num_gpus} is not a multiple of --nnodes {hosts}; every host runs --num-gpus / "
                          "--nnodes ranks.", param="nnodes")
    per_host = num_gpus // hosts
    if accelerator and per_host > hardware.num_devices:
        how = "described with --gpu-memory-gib" if hardware.described else "present"
        where = f" per host (--num-gpus {num_gpus} over --nnodes {hosts})" if hosts > 1 else ""
        raise ConfigError(
            f"--num-gpus {num_gpus} needs {per_host} {hardware.device_kind} device(s){where} but only "
            f"{hardware.num_devices} are {how}; lower --num-gpus.",
            param="num_gpus",
        )
    plan.num_gpus = num_gpus
    ctx = _Ctx(mode, hardware.min_free_bytes(per_host), num_gpus, accelerator)
    if accelerator:
        trace(f"hardware: {hardware.summary()}; min free over {num_gpus} selected = {ctx.min_free / GIB:.1f} GiB")
    else:
        trace(f"hardware: {hardware.summary()}; no accelerator, {num_gpus} rank(s) share the host")

    # 2. Residency: explicit choices first, then the DiT's mode default (the encoders' rule depends on it).
    explicit = _explicit_residency(args, profile)
    modes: dict[str, ResidencyMode] = {}
    for name, comp in profile.components.items():
        if name in explicit:
            modes[name] = explicit[name][0]
            trace(f"{name}: {modes[name].value} (explicit {explicit[name][1]})")
        elif comp.group == "dit":
            modes[name], why = _mode_default(comp, profile, ctx, dit_resident=False)
            if args.dit_layerwise_offload is False and modes[name] is ResidencyMode.LAYERWISE_OFFLOAD:
                modes[name], why = ResidencyMode.COMPONENT_OFFLOAD, why + "; --dit-layerwise-offload false -> component-offload"
            trace(f"{name}: {modes[name].value} ({why})")

    # 3. FSDP: explicit wins; auto shards the DiT only where the profile says it replaces DiT offload.
    dits = profile.group_members("dit")
    fsdp = args.use_fsdp_inference
    if fsdp is not None:
        trace(f"fsdp: {'on' if fsdp else 'off'} (explicit --use-fsdp-inference)")
    elif mode == "auto" and accelerator and num_gpus >= 2 and dits:
        offloaded = [d for d in dits if modes[d] is not ResidencyMode.RESIDENT]
        if profile.backend != "native":
            trace(f"fsdp: off (auto: {profile.family} runs on the diffusers backend, whose DiT is not sharded)")
        elif not profile.fsdp_can_replace_dit_offload:
            trace(f"fsdp: off (auto: {profile.family} profile does not let FSDP replace DiT offload)")
        elif any(d in explicit for d in dits):
            trace("fsdp: off (auto: the DiT residency was set explicitly)")
        elif not offloaded:
            trace("fsdp: off (auto: the DiT is resident, nothing to replace)")
        else:
            shard = sum(profile.components[d].param_bytes for d in dits) / num_gpus
            fsdp = shard <= profile.comfortable_fit_fraction * ctx.min_free
            trace(f"fsdp: {'on' if fsdp else 'off'} (auto: {profile.family} lets FSDP replace DiT offload on {num_gpus} "
                  f"GPUs; DiT shard {shard / GIB:.1f} GiB {'fits' if fsdp else 'does not fit'} in {ctx.min_free / GIB:.1f} GiB)")
    plan.use_fsdp_inference = bool(fsdp)
    if plan.use_fsdp_inference:
        if profile.backend != "native":
            raise diffusers_backend_refusal(profile.family, "--use-fsdp-inference")
        if num_gpus < 2:
            raise ConfigError("--use-fsdp-inference shards the DiT over GPUs; with --num-gpus 1 use component or layer-wise offload instead.", param="use_fsdp_inference")
        for d in dits:
            if d in explicit and modes[d] is not ResidencyMode.RESIDENT:
                raise ConfigError(
                    f"{explicit[d][1]} offloads {d} ({modes[d].value}) but --use-fsdp-inference shards it; "
                    f"FSDP replaces DiT offload, so drop one of them.",
                    param="use_fsdp_inference",
                )
            if d not in explicit and modes[d] is not ResidencyMode.RESIDENT:
                modes[d] = ResidencyMode.RESIDENT
                trace(f"{d}: resident (FSDP-sharded instead of offloaded)")

    # 4. The other components' mode defaults.
    dit_resident = bool(dits) and all(modes[d] is ResidencyMode.RESIDENT for d in dits)
    for name, comp in profile.components.items():
        if name not in modes:
            modes[name], why = _mode_default(comp, profile, ctx, dit_resident)
            trace(f"{name}: {modes[name].value} ({why})")

    # 5. Refuse explicit choices a component cannot do: never a silent fallback.
    for name, mode_ in modes.items():
        source = explicit.get(name, (None, "the performance mode"))[1]
        if mode_ is ResidencyMode.LAYERWISE_OFFLOAD and not profile.components[name].has_layers:
            raise ConfigError(
                f"{source}: {name} ({profile.components[name].class_name or 'unknown class'}) declares no layer "
                "structure, so layer-wise offload cannot run on it; use component-offload or snapshot-offload.",
                param=_param(source),
            )

    # 6. Layer-wise knobs: prefetch, resident sets, lifetimes, pinning.
    prefetch = args.dit_offload_prefetch_size
    if prefetch is not None and prefetch < 0:
        raise ConfigError(f"--dit-offload-prefetch-size must be 0 or more, got {prefetch}.", param="dit_offload_prefetch_size")
    if prefetch == 0:
        trace("prefetch: --dit-offload-prefetch-size 0 means 1")
    prefetch = max(1, prefetch or 1)
    flag = "--layerwise-resident-layers"
    counts = _select(flag, [_split(flag, i) for i in args.layerwise_resident_layers], profile)
    for value, source in counts.values():
        _parse_count(source, value)  # a bad value fails even where the knob ends up ignored
    flag = "--layerwise-residency-lifetime"
    lifetimes = _select(flag, [_split(flag, i) for i in args.layerwise_residency_lifetime], profile)
    for value, _ in lifetimes.values():
        _choice(flag, value, LIFETIMES)
    if args.dit_layerwise_residency_lifetime is not None:
        legacy = _choice("--dit-layerwise-residency-lifetime", args.dit_layerwise_residency_lifetime, LIFETIMES)
        for d in dits:
            lifetimes.setdefault(d, (legacy, f"--dit-layerwise-residency-lifetime {legacy}"))
    # Pinning is a CUDA feature; with CUDA it is on unless the user turned it off.
    pin = hardware.device_kind == "cuda" and args.pin_cpu_memory is not False
    for name, comp in profile.components.items():
        cp = ComponentPlan(name=name, group=comp.group, mode=modes[name])
        plan.components[name] = cp
        layerwise = cp.mode is ResidencyMode.LAYERWISE_OFFLOAD
        for chosen in (counts.get(name), lifetimes.get(name)):
            if chosen and not layerwise:
                trace(f"{name}: {chosen[1]} ignored, {name} is {cp.mode.value} (applies to layerwise-offload only)")
        if not layerwise:
            cp.pin_memory = pin and cp.mode is not ResidencyMode.RESIDENT
            continue
        cp.prefetch_size = prefetch
        if name in counts:
            cp.resident_layers = _resident_count(counts[name][1], counts[name][0], comp)
        if name in lifetimes:
            cp.lifetime = Lifetime(_choice("--layerwise-residency-lifetime", lifetimes[name][0], LIFETIMES))
        cp.pin_memory = pin
        trace(f"{name}: prefetch {prefetch}, {cp.resident_layers}/{comp.num_layers} layers resident ({cp.lifetime.value})")
    if args.pin_cpu_memory and hardware.device_kind != "cuda":
        trace(f"pin_cpu_memory: ignored on {hardware.device_kind} (pinned memory is a CUDA feature)")

    # 7. Permanent resident sets must fit beside the resident components at load.
    _check_permanent(plan, profile, ctx, lifetimes, trace)

    # 8. Parallelism, then compile and graphs.
    _resolve_parallelism(args, plan, profile, trace)
    _resolve_compile(args, plan, profile, hardware, trace)
    if profile.checkpoint is not None:
        trace(describe_model(profile))
    return plan


def describe_model(profile: ModelProfile) -> str:
    """One trace line of what the checkpoint is (its family spec applied to its configs, no weights)."""
    facts = profile.checkpoint
    assert facts is not None
    d = facts.defaults
    sizes = f"multiples of {facts.size_multiple}" if facts.size_multiple else "the pipeline's own rule"
    if facts.max_width and facts.max_height:
        sizes += f" up to {facts.max_width}x{facts.max_height} px"
    stepping = ("steps in a shared denoise group" if profile.supports_continuous else
                "runs as request-level batches (its family cannot step)")
    cfg = "; CFG: one doubled batch" if profile.cfg_batched else ""
    return (f"model: {profile.family} on the {profile.backend} backend; sizes {sizes}; defaults {d.width}x{d.height}, "
            f"{d.num_inference_steps} steps, guidance {d.guidance_scale:g}; --batching-mode continuous: {stepping}{cfg}")


def _resolve_sequence_degrees(args: DeploymentArgs, trace: Any) -> tuple[int, int]:
    """(ulysses, ring) from the three flags: --sp-degree alone runs as Ulysses; all three must agree."""
    ulysses = _positive("--ulysses-degree", args.ulysses_degree)
    ring = _positive("--ring-degree", args.ring_degree)
    if args.sp_degree is None:
        return ulysses, ring
    sp = _positive("--sp-degree", args.sp_degree)
    if args.ulysses_degree is None and args.ring_degree is None:
        trace(f"sequence parallel: --sp-degree {sp} runs as Ulysses {sp} (give --ring-degree to use ring attention)")
        return sp, 1
    if args.ulysses_degree is None and sp % ring == 0:
        return sp // ring, ring
    if args.ring_degree is None and sp % ulysses == 0:
        return ulysses, sp // ulysses
    if ulysses * ring != sp:
        raise ConfigError(f"--sp-degree {sp} must equal --ulysses-degree x --ring-degree ({ulysses} x {ring} = "
                          f"{ulysses * ring}); give two of the three flags.", param="sp_degree")
    return ulysses, ring


def diffusers_backend_refusal(family: str, flag: str) -> ConfigError:
    """The refusal of a parallel mode for a model the diffusers backend serves (`plan` and start-up alike)."""
    native = families.families_with("has_native")
    instead = ("serve it natively (--backend auto or native)" if family in native else
               f"serve a native family ({families.named_list(native)})")
    return ConfigError(f"{flag}: the {family} model runs on the diffusers backend, whose denoising loop cannot be "
                       f"split over ranks; serve it with --dp-size (one replica per rank), or {instead}.",
                       param=_param(flag))


def _check_parallel_support(profile: ModelProfile, ulysses: int, ring: int, tp: int, args: DeploymentArgs) -> None:
    """Refuse degrees the family, its backend or its DiT's head count cannot run, naming the flag (before any weight
    loads)."""
    sp_flag = "--ulysses-degree" if ulysses > 1 and args.ulysses_degree else "--ring-degree" if ring > 1 and args.ring_degree else "--sp-degree"
    if profile.backend != "native":
        for flag, on in ((sp_flag, ulysses * ring > 1), ("--tp-size", tp > 1),
                         ("--enable-cfg-parallel", bool(args.enable_cfg_parallel))):
            if on:
                raise diffusers_backend_refusal(profile.family, flag)
    if ulysses * ring > 1 and not profile.sequence_parallel:
        split = families.named_list(families.families_with("sequence_parallel"))
        raise ConfigError(f"{sp_flag}: the {profile.family} model has no sequence split in this release (sequence "
                          f"parallel runs for the native {split} DiTs); use --enable-cfg-parallel, "
                          "--use-fsdp-inference or --dp-size instead.", param=_param(sp_flag))
    if tp > 1 and not profile.tensor_parallel:
        plans = families.named_list(families.families_with("tensor_parallel"))
        raise ConfigError(f"--tp-size: the {profile.family} model has no tensor-parallel plan in this release (tensor "
                          f"parallel runs for the native {plans} DiTs); use --use-fsdp-inference to "
                          "shard its weights instead.", param="tp_size")
    heads = profile.dit_attention_heads
    if heads is None:
        return
    for flag, degree in (("--ulysses-degree", ulysses), ("--tp-size", tp), ("--ulysses-degree x --tp-size", ulysses * tp)):
        if degree > 1 and heads % degree:
            raise ConfigError(f"{flag} {degree} does not divide the DiT's {heads} attention heads; pick a degree that "
                              f"divides {heads} (or use --ring-degree, which splits keys and values instead of heads).",
                              param=_param(flag.split()[0]))


def _resolve_parallelism(args: DeploymentArgs, plan: DeploymentPlan, profile: ModelProfile, trace: Any) -> None:
    """Degrees, CFG parallel and data-parallel replicas; explicit flags win, and they must fill --num-gpus.

    A replica is cfg (1 or 2) x ulysses x ring x tp ranks; FSDP shards the DiT over a replica's ranks. When
    every degree comes from the mode (nothing explicit), ranks no degree uses become data-parallel replicas;
    explicit degrees that do not multiply to --num-gpus / --dp-size are refused.
    """
    ulysses, ring = _resolve_sequence_degrees(args, trace)
    tp = _positive("--tp-size", args.tp_size)
    _check_parallel_support(profile, ulysses, ring, tp, args)
    explicit_degrees = any(v is not None for v in (args.ulysses_degree, args.ring_degree, args.sp_degree, args.tp_size))
    cfg = args.enable_cfg_parallel
    if cfg and profile.cfg_batched:
        raise ConfigError(f"--enable-cfg-parallel: {profile.family} runs CFG as one doubled batch to match diffusers "
                          "exactly, which two ranks cannot reproduce; drop the flag (use --dp-size for throughput).",
                          param="enable_cfg_parallel")
    if cfg is None:
        policy_set = explicit_degrees or args.dp_size is not None
        cfg = (plan.performance_mode in ("auto", "speed") and plan.num_gpus >= 2 and profile.default_uses_cfg
               and not policy_set and not profile.cfg_batched and profile.backend == "native")
        if plan.num_gpus >= 2:
            reason = ("family default uses CFG, no parallelism flags" if cfg else
                      "parallelism flags set" if policy_set else
                      f"{profile.family} runs on the diffusers backend" if profile.backend != "native" else
                      f"{profile.family} does not run CFG by default" if not profile.default_uses_cfg else
                      f"{profile.family} runs CFG as one doubled batch" if profile.cfg_batched else
                      f"{plan.performance_mode} does not add it")
            trace(f"cfg_parallel: {'on' if cfg else 'off'} ({plan.performance_mode}: {reason})")
    else:
        trace(f"cfg_parallel: {'on' if cfg else 'off'} (explicit --enable-cfg-parallel)")
    degrees = (2 if cfg else 1) * ulysses * ring * tp
    what = f"cfg parallel ({2 if cfg else 1}) x --ulysses-degree {ulysses} x --ring-degree {ring} x --tp-size {tp} = {degrees} ranks"
    if args.dp_size is not None:
        dp = _positive("--dp-size", args.dp_size)
        if plan.num_gpus % dp:
            raise ConfigError(f"--dp-size {dp} does not divide --num-gpus {plan.num_gpus}; each replica needs the same "
                              "number of ranks.", param="dp_size")
        per_replica = plan.num_gpus // dp
        if degrees != per_replica and not (degrees == 1 and plan.use_fsdp_inference):
            raise ConfigError(f"{what}, but each of the {dp} replicas has {per_replica} (--num-gpus {plan.num_gpus} / "
                              f"--dp-size {dp}); make the degrees multiply to {per_replica}"
                              f"{' or add --use-fsdp-inference to shard over them' if degrees == 1 else ''}.",
                              param="dp_size")
        trace(f"dp: {dp} replica(s) of {per_replica} rank(s) (explicit --dp-size)")
    elif degrees > plan.num_gpus or plan.num_gpus % degrees:
        raise ConfigError(f"{what} but --num-gpus is {plan.num_gpus}; raise --num-gpus to a multiple of {degrees} or "
                          "lower the degrees.", param="num_gpus")
    elif plan.use_fsdp_inference and degrees == 1:
        dp = 1
        if plan.num_gpus > 1:
            trace(f"dp: 1 (FSDP shards the DiT over all {plan.num_gpus} ranks)")
    else:
        dp = plan.num_gpus // degrees
        if dp > 1 and (explicit_degrees or args.enable_cfg_parallel):
            raise ConfigError(f"{what} but --num-gpus is {plan.num_gpus}; make them equal, or add --dp-size {dp} to run "
                              f"{dp} replicas of {degrees} ranks.", param="num_gpus")
        if dp > 1:
            trace(f"dp: {dp} replica(s) of {degrees} rank(s) (the ranks no parallel degree uses each serve a replica)")
    if tp > 1 and ulysses * ring > 1:
        raise ConfigError("--tp-size together with sequence parallel (--ulysses-degree / --ring-degree) is not run in "
                          "this release; use one of them (with --enable-cfg-parallel if the model runs CFG).",
                          param="tp_size")
    if plan.use_fsdp_inference and tp > 1:
        raise ConfigError("--use-fsdp-inference with --tp-size would need 2-D (FSDP x TP) sharding, which this release "
                          "does not run; use one of them.", param="use_fsdp_inference")
    plan.enable_cfg_parallel, plan.ulysses_degree, plan.ring_degree, plan.tp_size, plan.dp_size = cfg, ulysses, ring, tp, dp
    plan.sp_degree = ulysses * ring
    if tp > 1:
        offloaded = [n for n, c in plan.components.items() if c.group == "dit" and c.mode is not ResidencyMode.RESIDENT]
        if offloaded:
            raise ConfigError(f"--tp-size {tp} splits {offloaded[0]}'s weights into per-rank DTensors, which offload "
                              f"cannot move; make the DiT resident (--component-residency dit=resident).",
                              param="tp_size")


def _resolve_compile(args: DeploymentArgs, plan: DeploymentPlan, profile: ModelProfile, hardware: HardwareInfo, trace: Any) -> None:
    """torch.compile follows the family's validated default unless set; breakable graphs are CUDA-only."""
    compile_on = args.enable_torch_compile
    if compile_on is None:
        compile_on = plan.performance_mode != "manual" and profile.compile_validated
        trace(f"compile: {'on' if compile_on else 'off'} ({plan.performance_mode}: {profile.family} compile_validated={profile.compile_validated})")
    else:
        trace(f"compile: {'on' if compile_on else 'off'} (explicit --enable-torch-compile)")
    plan.enable_torch_compile = compile_on
    plan.offload_during_compile = True if args.offload_during_compile is None else args.offload_during_compile
    plan.warmup_resolutions = _resolutions(args.warmup_resolutions)
    if args.enable_breakable_cuda_graph:
        if hardware.device_kind != "cuda":
            raise ConfigError(f"--enable-breakable-cuda-graph needs a CUDA device; this one is {hardware.device_kind}. Drop the flag.", param="enable_breakable_cuda_graph")
        if profile.kind != "image":
            raise ConfigError(f"--enable-breakable-cuda-graph supports image pipelines only; {profile.family} is {profile.kind}.", param="enable_breakable_cuda_graph")
        if not plan.warmup_resolutions:
            raise ConfigError("--enable-breakable-cuda-graph captures one graph per resolution: list every serving resolution in --warmup-resolutions.", param="warmup_resolutions")
        trace(f"breakable cuda graph: on for {', '.join(plan.warmup_resolutions)}")
    plan.enable_breakable_cuda_graph = bool(args.enable_breakable_cuda_graph)


def _check_permanent(plan: DeploymentPlan, profile: ModelProfile, ctx: _Ctx, lifetimes: dict[str, tuple[str, str]], trace: Any) -> None:
    """Resident components + every permanent set + the largest forward set + streaming buffers <= min free."""
    permanent = [c for c in plan.components.values() if c.lifetime is Lifetime.PERMANENT and c.mode is ResidencyMode.LAYERWISE_OFFLOAD and c.resident_layers]
    if not permanent:
        return
    if not ctx.accelerator:
        trace("permanent: fit check skipped, no accelerator (host memory is the device memory)")
        return
    layer = {n: profile.components[n].layer_bytes() for n in plan.components}
    shard = ctx.num_gpus if plan.use_fsdp_inference else 1
    resident = sum(profile.components[c.name].param_bytes // (shard if c.group == "dit" else 1)
                   for c in plan.components.values() if c.mode is ResidencyMode.RESIDENT)
    perm = sum(c.resident_layers * layer[c.name] for c in permanent)
    layerwise = [c for c in plan.components.values() if c.mode is ResidencyMode.LAYERWISE_OFFLOAD]
    forward = max([c.resident_layers * layer[c.name] for c in layerwise if c.lifetime is Lifetime.FORWARD] or [0])
    buffers = max((c.prefetch_size + 1) * layer[c.name] for c in layerwise)
    need = resident + perm + forward + buffers
    figures = (f"resident components {resident / GIB:.2f} + permanent sets {perm / GIB:.2f} + largest forward set "
               f"{forward / GIB:.2f} + streaming buffers {buffers / GIB:.2f} = {need / GIB:.2f} GiB")
    if need > ctx.min_free:
        source = lifetimes[permanent[0].name][1]
        raise ConfigError(
            f"{source}: permanent resident layer sets do not fit: {figures} > {ctx.min_free / GIB:.2f} GiB free on the "
            "smallest selected GPU. Keep lifetime forward or lower --layerwise-resident-layers.",
            param=_param(source),
        )
    trace(f"permanent: {figures} <= {ctx.min_free / GIB:.2f} GiB free -> fits")


def format_plan(plan: DeploymentPlan) -> str:
    """A human table of the plan (what `diffuserve plan` prints and start-up logs)."""
    rows = [("component", "group", "mode", "prefetch", "resident layers", "lifetime", "pinned")]
    for c in plan.components.values():
        layerwise = c.mode is ResidencyMode.LAYERWISE_OFFLOAD
        rows.append((c.name, c.group, c.mode.value, str(c.prefetch_size) if layerwise else "-",
                     str(c.resident_layers) if layerwise else "-", c.lifetime.value if layerwise else "-",
                     "yes" if c.pin_memory else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"Deployment plan (performance mode: {plan.performance_mode})"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    on = {True: "on", False: "off"}
    lines.append(
        f"  num_gpus={plan.num_gpus}  fsdp={on[plan.use_fsdp_inference]}  cfg_parallel={on[plan.enable_cfg_parallel]}  "
        f"ulysses={plan.ulysses_degree}  ring={plan.ring_degree}  tp={plan.tp_size}  dp={plan.dp_size}"
    )
    lines.append(
        f"  compile={on[plan.enable_torch_compile]}  offload_during_compile={on[plan.offload_during_compile]}  "
        f"breakable_cuda_graph={on[plan.enable_breakable_cuda_graph]}  warmup_resolutions={','.join(plan.warmup_resolutions) or '-'}"
    )
    lines.append("Why:")
    lines += [f"  - {line}" for line in plan.trace]
    return "\n".join(lines)
