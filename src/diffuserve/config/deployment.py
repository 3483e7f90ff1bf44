"""`resolve_plan(args, hardware, profile) -> DeploymentPlan`: the performance modes (the flags: `deployment_args.py`).

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

from dataclasses import dataclass
from typing import Any

from diffuserve import family_spec
from diffuserve.config.deployment_args import (
    LIFETIMES,
    PERFORMANCE_MODES,
    DeploymentArgs,
    flag_param,
    positive,
)
from diffuserve.config.model_profiles import ComponentProfile, ModelProfile
from diffuserve.config.parallel_plan import diffusers_backend_refusal, resolve_compile, resolve_parallelism
from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime, ResidencyMode
from diffuserve.config.residency_selectors import choose, explicit_residency, select_targets, split_selector
from diffuserve.errors import ConfigError
from diffuserve.hardware import GIB, HardwareInfo


@dataclass
class _Ctx:
    mode: str
    min_free: int
    num_gpus: int
    accelerator: bool


def _layerwise_or_offload(comp: ComponentProfile, allowed: bool) -> ResidencyMode:
    return ResidencyMode.LAYERWISE_OFFLOAD if allowed and comp.has_layers else ResidencyMode.COMPONENT_OFFLOAD


def _mode_default(
    comp: ComponentProfile, profile: ModelProfile, ctx: _Ctx, dit_resident: bool
) -> tuple[ResidencyMode, str]:
    """The performance mode's choice for a component the user left alone, and the rule that made it."""
    free_gib = ctx.min_free / GIB
    where = f"min free {free_gib:.1f} GiB over {ctx.num_gpus} GPU{'s' if ctx.num_gpus > 1 else ''}"
    large = comp.param_bytes >= profile.large_encoder_gib * GIB
    if ctx.mode in ("manual", "speed"):
        return ResidencyMode.RESIDENT, f"{ctx.mode}: unset -> resident"
    if ctx.mode == "memory":
        if comp.group == "dit":
            return _layerwise_or_offload(
                comp, profile.dit_supports_layerwise
            ), "memory: DiT offloaded, layer-wise where the family supports it"
        if comp.group in ("text_encoder", "image_encoder"):
            return _layerwise_or_offload(comp, large), "memory: encoder offloaded, layer-wise when large and layered"
        return _layerwise_or_offload(
            comp, True
        ), "memory: in the default layer-wise set, component offload when it declares no layers"
    if not ctx.accelerator:
        return ResidencyMode.RESIDENT, "auto: no accelerator, host memory is the device memory -> resident"
    if comp.group == "dit":
        threshold = profile.dit_resident_threshold_gib
        # A quantized DiT needs that much less room: the threshold drops by the bytes quantization saves.
        saved = max(0, comp.unquantized_bytes - comp.param_bytes) / GIB if comp.unquantized_bytes else 0.0
        bar = f"{threshold or 0:g} GiB" + (f" less the {saved:.1f} GiB quantization saves" if saved else "")
        if threshold is None:
            rule = f"auto: {profile.kind} family {profile.family} keeps DiT residency per model (no auto threshold)"
        elif free_gib >= threshold - saved:
            return ResidencyMode.RESIDENT, f"auto: {where} >= {bar} -> resident"
        else:
            rule = f"auto: {where} < {bar}"
        fits = comp.param_bytes <= profile.comfortable_fit_fraction * ctx.min_free
        mode = _layerwise_or_offload(comp, profile.dit_supports_layerwise and not fits)
        return mode, f"{rule}; DiT {'fits' if fits else 'does not fit'} comfortably -> {mode.value}"
    if comp.group in ("text_encoder", "image_encoder"):
        if dit_resident and large and comp.has_layers:
            return (
                ResidencyMode.LAYERWISE_OFFLOAD,
                f"auto: DiT resident and encoder >= {profile.large_encoder_gib:g} GiB (large) -> layerwise-offload",
            )
        # Small encoders: offloading one saves little memory but costs a host->GPU copy on every request, so it
        # stays on the GPU when the DiT does and the whole model fits comfortably (docs/deployment.md states it).
        total = sum(c.param_bytes for c in profile.components.values())
        budget = profile.comfortable_fit_fraction * ctx.min_free
        whole = (
            f"whole model {total / GIB:.1f} GiB vs {profile.comfortable_fit_fraction:g} x {where} "
            f"= {budget / GIB:.1f} GiB"
        )
        if not large and dit_resident and total <= budget:
            return ResidencyMode.RESIDENT, (
                f"auto: small encoder (< {profile.large_encoder_gib:g} GiB), DiT resident "
                f"and the {whole} fits -> resident"
            )
        why = "large encoder" if large else "DiT offloaded" if not dit_resident else f"the {whole} does not fit"
        return ResidencyMode.COMPONENT_OFFLOAD, f"auto: {why} -> component-offload (on the GPU only while it runs)"
    threshold = profile.vae_resident_threshold_gib
    if free_gib >= threshold:
        return ResidencyMode.RESIDENT, f"auto: {where} >= the VAE residency threshold {threshold:g} GiB -> resident"
    return (
        ResidencyMode.COMPONENT_OFFLOAD,
        f"auto: {where} < the VAE residency threshold {threshold:g} GiB -> component-offload",
    )


# --- helpers for the numeric knobs ----------------------------------------------------------------------
def _parse_count(source: str, text: str) -> int | float:
    """`N` (a layer count) or `0.r` (a ratio strictly between 0 and 1) of `--layerwise-resident-layers`."""
    try:
        number = float(text) if "." in text else int(text)
    except ValueError:
        raise ConfigError(
            f"{source}: N must be a layer count or a ratio 0<r<1.", param="layerwise_resident_layers"
        ) from None
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


def _resolve_devices(args: DeploymentArgs, hardware: HardwareInfo, plan: DeploymentPlan, hosts: int) -> _Ctx:
    """`--num-gpus` over `--nnodes` hosts against this host's devices; the smallest free memory among the selected
    ones is the budget every rule below reads."""
    trace = plan.trace.append
    accelerator = hardware.device_kind != "cpu"
    num_gpus = positive("--num-gpus", args.num_gpus)
    if num_gpus % hosts:
        raise ConfigError(
            f"--num-gpus {num_gpus} is not a multiple of --nnodes {hosts}; every host runs --num-gpus / "
            "--nnodes ranks.",
            param="nnodes",
        )
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
    ctx = _Ctx(plan.performance_mode, hardware.min_free_bytes(per_host), num_gpus, accelerator)
    if accelerator:
        trace(f"hardware: {hardware.summary()}; min free over {num_gpus} selected = {ctx.min_free / GIB:.1f} GiB")
    else:
        trace(f"hardware: {hardware.summary()}; no accelerator, {num_gpus} rank(s) share the host")
    return ctx


def _resolve_fsdp(
    args: DeploymentArgs,
    profile: ModelProfile,
    ctx: _Ctx,
    modes: dict[str, ResidencyMode],
    explicit: dict[str, tuple[ResidencyMode, str]],
    trace: Any,
) -> bool:
    """FSDP on or off; when on, an offloaded DiT becomes resident (sharded instead), unless offload was explicit."""
    dits = profile.group_members("dit")
    fsdp = args.use_fsdp_inference
    if fsdp is not None:
        trace(f"fsdp: {'on' if fsdp else 'off'} (explicit --use-fsdp-inference)")
    elif ctx.mode == "auto" and ctx.accelerator and ctx.num_gpus >= 2 and dits:
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
            shard = sum(profile.components[d].param_bytes for d in dits) / ctx.num_gpus
            fsdp = shard <= profile.comfortable_fit_fraction * ctx.min_free
            trace(
                f"fsdp: {'on' if fsdp else 'off'} (auto: {profile.family} lets FSDP replace DiT offload on "
                f"{ctx.num_gpus} GPUs; DiT shard {shard / GIB:.1f} GiB {'fits' if fsdp else 'does not fit'} in "
                f"{ctx.min_free / GIB:.1f} GiB)"
            )
    if fsdp:
        if profile.backend != "native":
            raise diffusers_backend_refusal(profile.family, "--use-fsdp-inference")
        if ctx.num_gpus < 2:
            raise ConfigError(
                "--use-fsdp-inference shards the DiT over GPUs; with --num-gpus 1 use component or layer-wise offload "
                "instead.",
                param="use_fsdp_inference",
            )
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
    return bool(fsdp)


def _plan_components(
    args: DeploymentArgs,
    plan: DeploymentPlan,
    profile: ModelProfile,
    modes: dict[str, ResidencyMode],
    hardware: HardwareInfo,
) -> dict[str, tuple[str, str]]:
    """Each component's plan: its mode, and for a layer-wise one the prefetch depth, resident layer set, lifetime
    and pinning. Returns the lifetimes chosen per component (with the flag that chose each)."""
    trace = plan.trace.append
    dits = profile.group_members("dit")
    prefetch = args.dit_offload_prefetch_size
    if prefetch is not None and prefetch < 0:
        raise ConfigError(
            f"--dit-offload-prefetch-size must be 0 or more, got {prefetch}.", param="dit_offload_prefetch_size"
        )
    if prefetch == 0:
        trace("prefetch: --dit-offload-prefetch-size 0 means 1")
    prefetch = max(1, prefetch or 1)
    flag = "--layerwise-resident-layers"
    counts = select_targets(flag, [split_selector(flag, i) for i in args.layerwise_resident_layers], profile)
    for value, source in counts.values():
        _parse_count(source, value)  # a bad value fails even where the knob ends up ignored
    flag = "--layerwise-residency-lifetime"
    lifetimes = select_targets(flag, [split_selector(flag, i) for i in args.layerwise_residency_lifetime], profile)
    for value, _ in lifetimes.values():
        choose(flag, value, LIFETIMES)
    if args.dit_layerwise_residency_lifetime is not None:
        legacy = choose("--dit-layerwise-residency-lifetime", args.dit_layerwise_residency_lifetime, LIFETIMES)
        for d in dits:
            lifetimes.setdefault(d, (legacy, f"--dit-layerwise-residency-lifetime {legacy}"))
    # Pinning is a CUDA feature; with CUDA it is on unless the user turned it off.
    pin = hardware.device_kind == "cuda" and args.pin_cpu_memory is not False
    for name, comp in profile.components.items():
        cp = ComponentPlan(
            name=name, group=comp.group, mode=modes[name], weight_bytes=comp.param_bytes, prequantized=comp.prequantized
        )
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
            cp.lifetime = Lifetime(choose("--layerwise-residency-lifetime", lifetimes[name][0], LIFETIMES))
        cp.pin_memory = pin
        sources = [chosen[1] for chosen in (counts.get(name), lifetimes.get(name)) if chosen]
        by = f" from {', '.join(sources)}" if sources else ""
        trace(
            f"{name}: prefetch {prefetch}, {cp.resident_layers}/{comp.num_layers} layers resident "
            f"({cp.lifetime.value}){by}"
        )
    if args.pin_cpu_memory and hardware.device_kind != "cuda":
        trace(f"pin_cpu_memory: ignored on {hardware.device_kind} (pinned memory is a CUDA feature)")
    return lifetimes


def resolve_plan(
    args: DeploymentArgs, hardware: HardwareInfo, profile: ModelProfile, *, hosts: int = 1
) -> DeploymentPlan:
    """Turn flags + hardware + model profile into a DeploymentPlan; every choice leaves a trace line.

    `hardware` is this host's; `hosts` (--nnodes) spreads --num-gpus over that many hosts like it."""
    mode = choose("--performance-mode", args.performance_mode, PERFORMANCE_MODES)
    plan = DeploymentPlan(performance_mode=mode)
    trace = plan.trace.append

    # 1. Devices: the smallest free memory among the selected ones is the bottleneck.
    ctx = _resolve_devices(args, hardware, plan, hosts)

    # 2. Residency: explicit choices first, then the DiT's mode default (the encoders' rule depends on it).
    explicit = explicit_residency(args, profile)
    modes: dict[str, ResidencyMode] = {}
    for name, comp in profile.components.items():
        if name in explicit:
            modes[name] = explicit[name][0]
            trace(f"{name}: {modes[name].value} (explicit {explicit[name][1]})")
        elif comp.group == "dit":
            modes[name], why = _mode_default(comp, profile, ctx, dit_resident=False)
            if args.dit_layerwise_offload is False and modes[name] is ResidencyMode.LAYERWISE_OFFLOAD:
                modes[name], why = (
                    ResidencyMode.COMPONENT_OFFLOAD,
                    why + "; --dit-layerwise-offload false -> component-offload",
                )
            trace(f"{name}: {modes[name].value} ({why})")

    # 3. FSDP: explicit wins; auto shards the DiT only where the profile says it replaces DiT offload.
    dits = profile.group_members("dit")
    plan.use_fsdp_inference = _resolve_fsdp(args, profile, ctx, modes, explicit, trace)

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
                param=flag_param(source),
            )

    # 6. Layer-wise knobs: prefetch, resident sets, lifetimes, pinning; one ComponentPlan per component.
    lifetimes = _plan_components(args, plan, profile, modes, hardware)

    # 7. Permanent resident sets must fit beside the resident components at load.
    _check_permanent(plan, profile, ctx, lifetimes, trace)

    # 8. Parallelism, then compile and graphs.
    resolve_parallelism(args, plan, profile, trace)
    resolve_compile(args, plan, profile, hardware, trace)
    if profile.checkpoint is not None:
        trace(describe_model(profile))
    return plan


def continuous_refusal(profile: ModelProfile) -> ConfigError:
    """`--batching-mode continuous` for a model that cannot step in a shared denoise group (its family has no
    per-row timestep, or the diffusers backend serves it): `plan` and start-up say the same words."""
    steppable = family_spec.named_list(family_spec.families_with("supports_continuous"))
    why = (
        "runs on the diffusers backend, whose denoising loop cannot be stepped row by row"
        if profile.backend != "native"
        else "cannot step in a shared denoise group"
    )
    return ConfigError(
        f"--batching-mode continuous: the {profile.family} model {why}; continuous batching serves "
        f"{steppable} natively. Use --batching-mode dynamic (requests merged per call) instead.",
        param="batching_mode",
    )


def describe_model(profile: ModelProfile) -> str:
    """One trace line of what the checkpoint is (its family spec applied to its configs, no weights)."""
    facts = profile.checkpoint
    assert facts is not None
    d = facts.defaults
    sizes = f"multiples of {facts.size_multiple}" if facts.size_multiple else "the pipeline's own rule"
    if facts.max_width and facts.max_height:
        sizes += f" up to {facts.max_width}x{facts.max_height} px"
    # What the model supports, not the mode in use (`describe_batching` says that).
    stepping = (
        "supported (steps in a shared denoise group)"
        if profile.supports_continuous
        else "not supported (request-level batches only: its family cannot step)"
    )
    cfg = "; CFG: one doubled batch" if profile.cfg_batched else ""
    return (
        f"model: {profile.family} on the {profile.backend} backend; sizes {sizes}; defaults {d.width}x{d.height}, "
        f"{d.num_inference_steps} steps, guidance {d.guidance_scale:g}; continuous batching {stepping}{cfg}"
    )


def describe_batching(mode: str | None) -> str:
    """The trace line of the batching mode in use (`serve`'s flag; `plan --batching-mode`, else the default)."""
    if mode is None:
        return "batching: --batching-mode singleton in use (the default; `plan --batching-mode` to check another)"
    return f"batching: --batching-mode {mode} in use"


def _check_permanent(
    plan: DeploymentPlan, profile: ModelProfile, ctx: _Ctx, lifetimes: dict[str, tuple[str, str]], trace: Any
) -> None:
    """Resident components + every permanent set + the largest forward set + streaming buffers <= min free."""
    permanent = [
        c
        for c in plan.components.values()
        if c.lifetime is Lifetime.PERMANENT and c.mode is ResidencyMode.LAYERWISE_OFFLOAD and c.resident_layers
    ]
    if not permanent:
        return
    if not ctx.accelerator:
        trace("permanent: fit check skipped, no accelerator (host memory is the device memory)")
        return
    layer = {n: profile.components[n].layer_bytes() for n in plan.components}
    shard = ctx.num_gpus if plan.use_fsdp_inference else 1
    resident = sum(
        profile.components[c.name].param_bytes // (shard if c.group == "dit" else 1)
        for c in plan.components.values()
        if c.mode is ResidencyMode.RESIDENT
    )
    perm = sum(c.resident_layers * layer[c.name] for c in permanent)
    layerwise = [c for c in plan.components.values() if c.mode is ResidencyMode.LAYERWISE_OFFLOAD]
    forward = max([c.resident_layers * layer[c.name] for c in layerwise if c.lifetime is Lifetime.FORWARD] or [0])
    buffers = max((c.prefetch_size + 1) * layer[c.name] for c in layerwise)
    need = resident + perm + forward + buffers
    figures = (
        f"resident components {resident / GIB:.2f} + permanent sets {perm / GIB:.2f} + largest forward set "
        f"{forward / GIB:.2f} + streaming buffers {buffers / GIB:.2f} = {need / GIB:.2f} GiB"
    )
    if need > ctx.min_free:
        source = lifetimes[permanent[0].name][1]
        raise ConfigError(
            f"{source}: permanent resident layer sets do not fit: {figures} > {ctx.min_free / GIB:.2f} GiB free on the "
            "smallest selected GPU. Keep lifetime forward or lower --layerwise-resident-layers.",
            param=flag_param(source),
        )
    trace(f"permanent: {figures} <= {ctx.min_free / GIB:.2f} GiB free -> fits")


def brief_plan(plan: DeploymentPlan) -> str:
    """The plan in one line (what `generate` logs; `diffuserve plan` and `--log-level debug` show the whole)."""
    modes = ", ".join(f"{c.name} {c.mode.value}" for c in plan.components.values())
    compile_ = "on" if plan.enable_torch_compile else "off"
    return f"deployment plan: {modes}; num_gpus={plan.num_gpus} compile={compile_} (the whole: `diffuserve plan`)"


def _weights_cell(component: Any) -> str:
    """`1.2 GiB`, or `310.4 MiB gguf:Q4_K` for pre-quantized weights."""
    size = float(component.weight_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    text = f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
    return f"{text} {component.prequantized}" if component.prequantized else text


def format_plan(plan: DeploymentPlan) -> str:
    """A human table of the plan (what `diffuserve plan` prints and start-up logs)."""
    rows = [
        ("component", "group", "weights", "mode", "prefetch", "resident layers", "lifetime", "pinned", "quantization")
    ]
    for c in plan.components.values():
        layerwise = c.mode is ResidencyMode.LAYERWISE_OFFLOAD
        rows.append(
            (
                c.name,
                c.group,
                _weights_cell(c),
                c.mode.value,
                str(c.prefetch_size) if layerwise else "-",
                str(c.resident_layers) if layerwise else "-",
                c.lifetime.value if layerwise else "-",
                "yes" if c.pin_memory else "no",
                c.quantization or "-",
            )
        )
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
        f"breakable_cuda_graph={on[plan.enable_breakable_cuda_graph]}  "
        f"warmup_resolutions={','.join(plan.warmup_resolutions) or '-'}"
    )
    if plan.activation_memory_source:
        budget = plan.activation_memory_bytes
        amount = "unbounded" if budget is None else f"{budget / GIB:.2f} GiB per replica"
        lines.append(f"  activation memory: {amount} ({plan.activation_memory_source})")
    lines.append("Why:")
    lines += [f"  - {line}" for line in plan.trace]
    return "\n".join(lines)
