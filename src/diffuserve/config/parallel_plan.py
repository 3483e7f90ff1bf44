"""The parallel part of a deployment plan: sequence-parallel degrees, tensor parallel, CFG parallel, data-parallel
replicas, which families and backends can run them, and the compile / CUDA-graph switches. Pure, like
`config/deployment.py`, which calls it after residency is resolved."""

from __future__ import annotations

import re
from typing import Any

from diffuserve import family_spec
from diffuserve.config.deployment_args import DeploymentArgs, flag_param, positive
from diffuserve.config.model_profiles import ModelProfile
from diffuserve.config.plan import DeploymentPlan, ResidencyMode
from diffuserve.errors import ConfigError
from diffuserve.hardware import HardwareInfo

_RESOLUTION = re.compile(r"^(\d+)[xX](\d+)$")


def _resolutions(items: list[str]) -> list[str]:
    out = []
    for item in items:
        match = _RESOLUTION.match(item.strip())
        if not match or int(match.group(1)) == 0 or int(match.group(2)) == 0:
            raise ConfigError(
                f"--warmup-resolutions: {item!r} is not WxH (e.g. 1024x1024).", param="warmup_resolutions"
            )
        out.append(f"{int(match.group(1))}x{int(match.group(2))}")
    return out


# --- the resolver ---------------------------------------------------------------------------------------
def _resolve_sequence_degrees(args: DeploymentArgs, trace: Any) -> tuple[int, int]:
    """(ulysses, ring) from the three flags: --sp-degree alone runs as Ulysses; all three must agree."""
    ulysses = positive("--ulysses-degree", args.ulysses_degree)
    ring = positive("--ring-degree", args.ring_degree)
    if args.sp_degree is None:
        return ulysses, ring
    sp = positive("--sp-degree", args.sp_degree)
    if args.ulysses_degree is None and args.ring_degree is None:
        trace(f"sequence parallel: --sp-degree {sp} runs as Ulysses {sp} (give --ring-degree to use ring attention)")
        return sp, 1
    if args.ulysses_degree is None and sp % ring == 0:
        return sp // ring, ring
    if args.ring_degree is None and sp % ulysses == 0:
        return ulysses, sp // ulysses
    if ulysses * ring != sp:
        raise ConfigError(
            f"--sp-degree {sp} must equal --ulysses-degree x --ring-degree ({ulysses} x {ring} = "
            f"{ulysses * ring}); give two of the three flags.",
            param="sp_degree",
        )
    return ulysses, ring


def diffusers_backend_refusal(family: str, flag: str) -> ConfigError:
    """The refusal of a parallel mode for a model the diffusers backend serves (`plan` and start-up alike)."""
    native = family_spec.families_with("has_native")
    instead = (
        "serve it natively (--backend auto or native)"
        if family in native
        else f"serve a native family ({family_spec.named_list(native)})"
    )
    return ConfigError(
        f"{flag}: the {family} model runs on the diffusers backend, whose denoising loop cannot be "
        f"split over ranks; serve it with --dp-size (one replica per rank), or {instead}.",
        param=flag_param(flag),
    )


def _check_parallel_support(profile: ModelProfile, ulysses: int, ring: int, tp: int, args: DeploymentArgs) -> None:
    """Refuse degrees the family, its backend or its DiT's head count cannot run, naming the flag (before any weight
    loads)."""
    sp_flag = (
        "--ulysses-degree"
        if ulysses > 1 and args.ulysses_degree
        else "--ring-degree"
        if ring > 1 and args.ring_degree
        else "--sp-degree"
    )
    if profile.backend != "native":
        for flag, on in (
            (sp_flag, ulysses * ring > 1),
            ("--tp-size", tp > 1),
            ("--enable-cfg-parallel", bool(args.enable_cfg_parallel)),
        ):
            if on:
                raise diffusers_backend_refusal(profile.family, flag)
    if ulysses * ring > 1 and not profile.sequence_parallel:
        split = family_spec.named_list(family_spec.families_with("sequence_parallel"))
        raise ConfigError(
            f"{sp_flag}: the {profile.family} model has no sequence split in this release (sequence "
            f"parallel runs for the native {split} DiTs); use --enable-cfg-parallel, "
            "--use-fsdp-inference or --dp-size instead.",
            param=flag_param(sp_flag),
        )
    if tp > 1 and not profile.tensor_parallel:
        plans = family_spec.named_list(family_spec.families_with("tensor_parallel"))
        raise ConfigError(
            f"--tp-size: the {profile.family} model has no tensor-parallel plan in this release (tensor "
            f"parallel runs for the native {plans} DiTs); use --use-fsdp-inference to "
            "shard its weights instead.",
            param="tp_size",
        )
    heads = profile.dit_attention_heads
    if heads is None:
        return
    for flag, degree in (
        ("--ulysses-degree", ulysses),
        ("--tp-size", tp),
        ("--ulysses-degree x --tp-size", ulysses * tp),
    ):
        if degree > 1 and heads % degree:
            raise ConfigError(
                f"{flag} {degree} does not divide the DiT's {heads} attention heads; pick a degree that "
                f"divides {heads} (or use --ring-degree, which splits keys and values instead of heads).",
                param=flag_param(flag.split()[0]),
            )


def _resolve_cfg_parallel(
    args: DeploymentArgs,
    plan: DeploymentPlan,
    profile: ModelProfile,
    cfg: bool | None,
    explicit_degrees: bool,
    trace: Any,
) -> bool:
    """CFG parallel: explicit wins; `auto` / `speed` turn it on with 2+ GPUs for a native family whose default runs
    CFG as two passes, when no other parallel flag is set. Every outcome leaves its reason in the trace."""
    if cfg is None:
        policy_set = explicit_degrees or args.dp_size is not None
        cfg = (
            plan.performance_mode in ("auto", "speed")
            and plan.num_gpus >= 2
            and profile.default_uses_cfg
            and not policy_set
            and not profile.cfg_batched
            and profile.backend == "native"
        )
        if plan.num_gpus >= 2:
            reason = (
                "family default uses CFG, no parallelism flags"
                if cfg
                else "parallelism flags set"
                if policy_set
                else f"{profile.family} runs on the diffusers backend"
                if profile.backend != "native"
                else f"{profile.family} does not run CFG by default"
                if not profile.default_uses_cfg
                else f"{profile.family} runs CFG as one doubled batch"
                if profile.cfg_batched
                else f"{plan.performance_mode} does not add it"
            )
            trace(f"cfg_parallel: {'on' if cfg else 'off'} ({plan.performance_mode}: {reason})")
    else:
        trace(f"cfg_parallel: {'on' if cfg else 'off'} (explicit --enable-cfg-parallel)")
    return bool(cfg)


def _resolve_replicas(
    args: DeploymentArgs, plan: DeploymentPlan, degrees: int, what: str, explicit_degrees: bool, trace: Any
) -> int:
    """Data-parallel replicas: `--dp-size` must divide --num-gpus into replicas of `degrees` ranks; unset, the ranks
    no parallel degree uses become replicas (refused when degrees or CFG parallel were explicit)."""
    if args.dp_size is not None:
        dp = positive("--dp-size", args.dp_size)
        if plan.num_gpus % dp:
            raise ConfigError(
                f"--dp-size {dp} does not divide --num-gpus {plan.num_gpus}; each replica needs the same "
                "number of ranks.",
                param="dp_size",
            )
        per_replica = plan.num_gpus // dp
        if degrees != per_replica and not (degrees == 1 and plan.use_fsdp_inference):
            raise ConfigError(
                f"{what}, but each of the {dp} replicas has {per_replica} (--num-gpus {plan.num_gpus} / "
                f"--dp-size {dp}); make the degrees multiply to {per_replica}"
                f"{' or add --use-fsdp-inference to shard over them' if degrees == 1 else ''}.",
                param="dp_size",
            )
        trace(f"dp: {dp} replica(s) of {per_replica} rank(s) (explicit --dp-size)")
    elif degrees > plan.num_gpus or plan.num_gpus % degrees:
        raise ConfigError(
            f"{what} but --num-gpus is {plan.num_gpus}; raise --num-gpus to a multiple of {degrees} or "
            "lower the degrees.",
            param="num_gpus",
        )
    elif plan.use_fsdp_inference and degrees == 1:
        dp = 1
        if plan.num_gpus > 1:
            trace(f"dp: 1 (FSDP shards the DiT over all {plan.num_gpus} ranks)")
    else:
        dp = plan.num_gpus // degrees
        if dp > 1 and (explicit_degrees or args.enable_cfg_parallel):
            raise ConfigError(
                f"{what} but --num-gpus is {plan.num_gpus}; make them equal, or add --dp-size {dp} to run "
                f"{dp} replicas of {degrees} ranks.",
                param="num_gpus",
            )
        if dp > 1:
            trace(f"dp: {dp} replica(s) of {degrees} rank(s) (the ranks no parallel degree uses each serve a replica)")
    return dp


def resolve_parallelism(args: DeploymentArgs, plan: DeploymentPlan, profile: ModelProfile, trace: Any) -> None:
    """Degrees, CFG parallel and data-parallel replicas; explicit flags win, and they must fill --num-gpus.

    A replica is cfg (1 or 2) x ulysses x ring x tp ranks; FSDP shards the DiT over a replica's ranks. When
    every degree comes from the mode (nothing explicit), ranks no degree uses become data-parallel replicas;
    explicit degrees that do not multiply to --num-gpus / --dp-size are refused.
    """
    ulysses, ring = _resolve_sequence_degrees(args, trace)
    tp = positive("--tp-size", args.tp_size)
    _check_parallel_support(profile, ulysses, ring, tp, args)
    explicit_degrees = any(v is not None for v in (args.ulysses_degree, args.ring_degree, args.sp_degree, args.tp_size))
    cfg = args.enable_cfg_parallel
    if cfg and profile.cfg_batched:
        raise ConfigError(
            f"--enable-cfg-parallel: {profile.family} runs CFG as one doubled batch to match diffusers "
            "exactly, which two ranks cannot reproduce; drop the flag (use --dp-size for throughput).",
            param="enable_cfg_parallel",
        )
    cfg = _resolve_cfg_parallel(args, plan, profile, cfg, explicit_degrees, trace)
    degrees = (2 if cfg else 1) * ulysses * ring * tp
    what = (
        f"cfg parallel ({2 if cfg else 1}) x --ulysses-degree {ulysses} x --ring-degree {ring} x --tp-size {tp} = "
        f"{degrees} ranks"
    )
    dp = _resolve_replicas(args, plan, degrees, what, explicit_degrees, trace)
    if tp > 1 and ulysses * ring > 1:
        raise ConfigError(
            "--tp-size together with sequence parallel (--ulysses-degree / --ring-degree) is not run in "
            "this release; use one of them (with --enable-cfg-parallel if the model runs CFG).",
            param="tp_size",
        )
    if plan.use_fsdp_inference and tp > 1:
        raise ConfigError(
            "--use-fsdp-inference with --tp-size would need 2-D (FSDP x TP) sharding, which this release "
            "does not run; use one of them.",
            param="use_fsdp_inference",
        )
    plan.enable_cfg_parallel, plan.ulysses_degree, plan.ring_degree, plan.tp_size, plan.dp_size = (
        cfg,
        ulysses,
        ring,
        tp,
        dp,
    )
    plan.sp_degree = ulysses * ring
    if tp > 1:
        offloaded = [n for n, c in plan.components.items() if c.group == "dit" and c.mode is not ResidencyMode.RESIDENT]
        if offloaded:
            raise ConfigError(
                f"--tp-size {tp} splits {offloaded[0]}'s weights into per-rank DTensors, which offload "
                f"cannot move; make the DiT resident (--component-residency dit=resident).",
                param="tp_size",
            )


def resolve_compile(
    args: DeploymentArgs, plan: DeploymentPlan, profile: ModelProfile, hardware: HardwareInfo, trace: Any
) -> None:
    """torch.compile follows the family's validated default unless set; breakable graphs are CUDA-only."""
    compile_on = args.enable_torch_compile
    if compile_on is None:
        compile_on = plan.performance_mode != "manual" and profile.compile_validated
        trace(
            f"compile: {'on' if compile_on else 'off'} ({plan.performance_mode}: {profile.family} "
            f"compile_validated={profile.compile_validated})"
        )
    else:
        trace(f"compile: {'on' if compile_on else 'off'} (explicit --enable-torch-compile)")
    plan.enable_torch_compile = compile_on
    plan.offload_during_compile = True if args.offload_during_compile is None else args.offload_during_compile
    plan.warmup_resolutions = _resolutions(args.warmup_resolutions)
    if args.enable_breakable_cuda_graph:
        if hardware.device_kind != "cuda":
            raise ConfigError(
                f"--enable-breakable-cuda-graph needs a CUDA device; this one is {hardware.device_kind}. "
                "Drop the flag.",
                param="enable_breakable_cuda_graph",
            )
        if profile.kind != "image":
            raise ConfigError(
                f"--enable-breakable-cuda-graph supports image pipelines only; {profile.family} is {profile.kind}.",
                param="enable_breakable_cuda_graph",
            )
        if not plan.warmup_resolutions:
            raise ConfigError(
                "--enable-breakable-cuda-graph captures one graph per resolution: list every serving resolution in "
                "--warmup-resolutions.",
                param="warmup_resolutions",
            )
        trace(f"breakable cuda graph: on for {', '.join(plan.warmup_resolutions)}")
    plan.enable_breakable_cuda_graph = bool(args.enable_breakable_cuda_graph)
