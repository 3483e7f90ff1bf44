"""One rank's set-up, the same on every rank: checkpoint, device and plan, then
load -> shard -> residency -> parallel -> compile -> (operator-only) fault injection, which yields the rank's
`ServingPipeline` (pipelines/serving.py): the one place that builds the object that serves.

Used by the serving root (launch/root.py) for rank 0 or a single process and by every follower
(launch/follower.py); it knows nothing of HTTP, the scheduler or the engine loop.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.launch.ranks import LaunchInfo, hosts_of
from diffuserve.pipelines.serving import ServingPipeline

logger = logging.getLogger("diffuserve")


def resolve_model_path(args: ServerArgs, *, quiet: bool = False) -> Path:
    """--model-path, or the embedded default model (built once into the cache; said in the log unless `quiet`)."""
    if args.model.model_path:
        return Path(args.model.model_path)
    from diffuserve.models.tiny import ensure_default_model

    path = ensure_default_model()
    if not quiet:
        logger.info("no --model-path: using the embedded default model at %s", path)
    return path


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_num_threads(num_threads: int | None, device: str, local_ranks: int = 1) -> int | None:
    """Threads for torch's intra-op pool; None leaves torch's choice.

    On a CPU device the default is every core but one: the process also runs the HTTP event loop,
    JSON/base64 and image encoding, and OpenMP workers that lose their core to them stall at every
    small op (measured: the tiny model's singleton serving fell from 22 to 4 img/s with 2 threads on
    2 cores). An explicit OMP_NUM_THREADS is respected. Several ranks on one CPU host share those cores.
    """
    if num_threads is not None:
        return num_threads
    if os.environ.get("OMP_NUM_THREADS") or not device.startswith("cpu"):
        return None
    return max(1, ((os.cpu_count() or 1) - 1) // local_ranks)


def apply_num_threads(num_threads: int | None, device: str, local_ranks: int = 1) -> None:
    threads = resolve_num_threads(num_threads, device, local_ranks)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        logger.info("torch intra-op threads: %d", threads)


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass
class ResolvedDeployment:
    plan: Any
    """The DeploymentPlan."""
    device_budget_bytes: int | None
    """Free device memory the permanent residency sets must fit in (None on a CPU host)."""


def resolve_deployment(
    deployment: Any,
    model_path: Path,
    *,
    model_id: str | None,
    dtype: str | None,
    hardware: Any,
    hosts: int = 1,
    backend: str = "auto",
    batching_mode: str | None = None,
    quant: Any = None,
    transformer_path: str | None = None,
    activation_memory_gib: float | None = None,
    batching_max_tokens: int | None = None,
    batching_max_size: int = 1,
    controlnet: list[str] | None = None,
) -> Any:
    """The plan for a checkpoint from JSON and safetensors / GGUF headers only (no weights loaded), for the backend
    `--backend` picks, the batching mode and `--quantization` (`quant`: QuantArgs; a quantized component is counted
    at its quantized size), so `plan` and start-up refuse the same things with the same words.
    `transformer_path` (`--transformer-path`): the transformer is counted at that file's bytes and method.
    `controlnet` (`--controlnet`): each ControlNet is a component beside the base (family-checked, counted)."""
    from diffuserve.config.deployment import continuous_refusal, describe_batching, resolve_plan
    from diffuserve.config.model_profiles import profile_from_checkpoint
    from diffuserve.config.quantization import annotate, plan_quantization
    from diffuserve.config.token_budget import check_checkpoint_tokens
    from diffuserve.errors import ConfigError

    profile = profile_from_checkpoint(model_path, model_id=model_id, load_dtype=dtype, backend=backend)
    if transformer_path is not None:
        from diffuserve.models.single_file import with_transformer_file

        profile = with_transformer_file(profile, transformer_path, dtype)
    if controlnet:
        from diffuserve.models.controlnets import with_controlnets

        profile = with_controlnets(profile, controlnet, dtype)
    if batching_mode == "continuous" and not profile.supports_continuous:
        raise continuous_refusal(profile)
    check_checkpoint_tokens(batching_max_tokens, batching_max_size, profile.kind, profile.checkpoint)
    quantized, profile = plan_quantization(quant, profile, hardware.device_kind, model_path, dtype)
    if transformer_path is not None and "transformer" in quantized.components:
        raise ConfigError(
            f"--quantization: the transformer comes pre-quantized from --transformer-path "
            f"({profile.components['transformer'].prequantized}); quantize other components by name (e.g. "
            "--quantization text_encoder=int8) or drop one of the two flags.",
            param="quantization",
        )
    plan = resolve_plan(deployment, hardware, profile, hosts=hosts)
    if controlnet:
        from diffuserve.models.controlnets import check_parallel as check_controlnet_parallel

        check_controlnet_parallel(plan)
    annotate(plan, quantized)
    plan.trace.append(describe_batching(batching_mode))
    if transformer_path is not None:
        from diffuserve.models.single_file import check_parallel

        check_parallel(plan, profile.components["transformer"].prequantized)
    set_activation_budget(plan, profile, hardware, activation_memory_gib, hosts)
    return plan


def set_activation_budget(plan: Any, profile: Any, hardware: Any, override_gib: float | None, hosts: int) -> None:
    """The plan's activation budget (activation.py): the override, else the free memory of the selected devices
    (CPU: the available RAM now) after the weights the plan keeps on one device."""
    from diffuserve.activation import activation_budget, host_available_bytes, weights_on_device

    kind = "cpu" if not hardware.gpus else hardware.device_kind
    free = hardware.min_free_bytes(plan.num_gpus // hosts) if hardware.gpus else host_available_bytes()
    budget = activation_budget(
        override_gib=override_gib,
        device_kind=kind,
        free_bytes=free,
        weights_on_device=weights_on_device(plan, profile, kind),
    )
    plan.activation_memory_bytes, plan.activation_memory_source = budget.bytes, budget.source


def plan_deployment(
    args: ServerArgs, model_path: Path, device: str, *, log_plan: bool = True, brief: bool = False
) -> ResolvedDeployment:
    """Resolve and log the deployment plan for this machine (`brief`: one line, the table at debug level)."""
    from diffuserve.config.deployment import DeploymentArgs, brief_plan, format_plan
    from diffuserve.hardware import detect_hardware

    hardware = detect_hardware(device)
    plan = resolve_deployment(
        args.deployment or DeploymentArgs(),
        model_path,
        model_id=args.model.model_id,
        dtype=resolve_dtype(args.model.dtype, device),
        hardware=hardware,
        hosts=hosts_of(args),
        backend=args.model.backend,
        batching_mode=str(args.batching.mode),
        quant=args.quant,
        transformer_path=args.model.transformer_path,
        activation_memory_gib=args.engine.activation_memory_gib,
        batching_max_tokens=args.batching.max_tokens,
        batching_max_size=args.batching.max_size,
        controlnet=args.control.controlnet,
    )
    if log_plan and brief:
        logger.info("%s", brief_plan(plan))
        logger.debug("deployment plan:\n%s", format_plan(plan))
    elif log_plan:
        logger.info("deployment plan:\n%s", format_plan(plan))
    from diffuserve.runtime.compile import check_executable

    check_executable(plan)
    budget = hardware.min_free_bytes(plan.num_gpus // hosts_of(args)) if hardware.gpus else None
    return ResolvedDeployment(plan, budget)


class _DropTorchvisionFallback(logging.Filter):
    """transformers' "`XImageProcessor` requires torchvision (not installed); falling back to ..." (one per
    processor class): the PIL processors it falls back to are the ones we use, so at info it is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back" not in record.getMessage()


def quiet_library_loading() -> None:
    """Below debug, keep transformers' loading chatter (the torchvision fallback notes and its per-component
    "Loading weights" progress bars) out of the log; `--log-level debug` shows them again."""
    if logger.getEffectiveLevel() <= logging.DEBUG:
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers is a dependency; nothing to quiet without it
        return
    hf_logging.disable_progress_bar()
    fallback = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _DropTorchvisionFallback) for f in fallback.filters):
        fallback.addFilter(_DropTorchvisionFallback())
    from diffuserve.quant.methods import quiet_torchao

    quiet_torchao()


def load_serving_pipeline(
    args: ServerArgs,
    model_path: Path,
    device: str,
    deployment: ResolvedDeployment,
    metrics: EngineMetrics | None,
    groups: Any = None,
) -> ServingPipeline:
    """Load the pipeline, give it residency and (on several ranks, `groups`) the plan's parallel modes, compile,
    and serve it with (operator-only) fault injection."""
    from diffuserve.models.loader import load_pipeline
    from diffuserve.pipelines.fault_hooks import maybe_inject_faults

    quiet_library_loading()
    quantization = {
        name: (c.quantization, c.quant_keep) for name, c in deployment.plan.components.items() if c.quantization
    }
    if quantization:  # a method the device's torch cannot run is refused before any weight loads
        from diffuserve.quant.apply import check_methods

        check_methods(quantization, device)
    # To host: the residency manager below moves resident components to the device and leaves offloaded ones
    # on the host, so a model that fits only when offloaded still loads.
    pipeline = load_pipeline(
        model_path,
        model_id=args.model.model_id,
        backend=args.model.backend,
        device=device,
        dtype=resolve_dtype(args.model.dtype, device),
        placement="host",
        quantization=quantization,
        transformer_path=args.model.transformer_path,
    )
    applied: list[str] = []
    if args.control.controlnet:  # before residency: each ControlNet is a component the plan places
        from diffuserve.models.controlnets import install_controlnets

        install_controlnets(pipeline, args.control.controlnet)
    if args.lora.enabled:
        _install_lora(args, pipeline, device, multi_rank=groups is not None, metrics=metrics)
    if groups is not None:
        from diffuserve.parallel.apply import shard_weights

        applied += shard_weights(pipeline, deployment.plan, groups, device_type=device.split(":")[0])
    if pipeline.components:
        import torch

        from diffuserve.runtime.ledger import TransferLedger
        from diffuserve.runtime.residency import build_residency

        ledger = TransferLedger()
        if metrics is not None:
            ledger.forward_to(metrics)
        pipeline.use_residency(
            build_residency(
                deployment.plan,
                pipeline.components,
                device=torch.device(device),
                ledger=ledger,
                device_budget_bytes=deployment.device_budget_bytes,
            )
        )
    if groups is not None:
        from diffuserve.parallel.apply import apply_parallelism

        applied += apply_parallelism(pipeline, deployment.plan, groups)
        if applied:
            logger.info("parallel modes: %s", ", ".join(applied))
    from diffuserve.runtime.compile import apply_compile

    apply_compile(pipeline.components, deployment.plan)
    return maybe_inject_faults(ServingPipeline.of(pipeline, parallel=applied))


def _install_lora(
    args: ServerArgs, pipeline: Any, device: str, *, multi_rank: bool, metrics: EngineMetrics | None = None
) -> None:
    """--lora-modules / --enable-lora-updates: read the start-up adapters through diffusers, hook the denoisers'
    adapted layers, and give the process's adapter registry (`lora/registry.py`) the reader runtime loads use."""
    from diffuserve.errors import ConfigError

    # On several ranks (`multi_rank`) every rank reads the same adapters; tensor parallel then cuts each rank's
    # slices of the slots (lora/sharding.py), and FSDP, CFG and sequence parallel use whole slots. A runtime load
    # reaches rank 0 only, so runtime changes stay on one process.
    if multi_rank and args.lora.enable_lora_updates:
        raise ConfigError(
            "--enable-lora-updates: runtime adapter loads reach one process only; on several ranks load the "
            "adapters at start-up with --lora-modules."
        )
    import torch

    from diffuserve.lora.registry import lora_registry
    from diffuserve.lora.slots import install_registry

    registry = lora_registry(args.lora)
    bank = install_registry(
        pipeline,
        pipeline.family,
        registry,
        max_rank=args.lora.max_lora_rank,
        device=device,
        dtype=getattr(torch, resolve_dtype(args.model.dtype, device)),
        runtime_updates=args.lora.enable_lora_updates,
    )
    if bank is None:
        logger.info("LoRA adapters: %s (diffusers backend: one adapter set per call)", ", ".join(args.lora.adapters))
        return
    if metrics is not None:  # read at scrape time
        for where in ("registered", "host", "device"):
            metrics.lora_adapters.labels(where=where).set_function(lambda where=where: registry.counts()[where])
    logger.info(
        "LoRA adapters: %s (%d adapted layers, %d slots of rank %d, %.1f MiB, %d in host memory%s)",
        ", ".join(bank.slots) or "none yet",
        bank.layers,
        args.lora.max_loras,
        args.lora.max_lora_rank,
        bank.nbytes / 2**20,
        args.lora.host_capacity,
        f"; runtime loads from {args.lora.lora_root}" if args.lora.enable_lora_updates else "",
    )


@dataclass
class RankSetup:
    """What every rank resolves the same way before loading: the checkpoint, its device and the plan."""

    model_path: Path
    """The checkpoint folder."""
    device: str
    """This rank's device (cuda:{local_rank} or cpu)."""
    deployment: ResolvedDeployment
    """The plan (identical on every rank: same flags, same checkpoint headers)."""


def prepare_rank(args: ServerArgs, info: LaunchInfo | None, *, log_plan: bool = True, brief: bool = False) -> RankSetup:
    """Validate, find the checkpoint, resolve the plan for this rank's device (logged whole, or in one line when
    `brief`), size its thread pool."""
    args.validate()
    model_path = resolve_model_path(args)
    if args.step_cache.calibration:  # a MagCache file made for another checkpoint is refused before any load
        from diffuserve.models.fingerprint import check_calibration

        check_calibration(
            args.step_cache.calibration, model_path, model_id=args.model.model_id, backend=args.model.backend
        )
    device = resolve_device(args.model.device)
    if info is not None:
        device = info.device(device)
    deployment = plan_deployment(args, model_path, device, log_plan=log_plan, brief=brief)
    apply_num_threads(args.model.num_threads, device, info.local_world_size if info is not None else 1)
    return RankSetup(model_path, device, deployment)


def load_rank_pipeline(
    args: ServerArgs, setup: RankSetup, groups: Any, metrics: EngineMetrics | None = None
) -> ServingPipeline:
    """One rank's pipeline: loaded, with residency and this rank's share of the plan's parallel modes."""
    return load_serving_pipeline(args, setup.model_path, setup.device, setup.deployment, metrics, groups)
