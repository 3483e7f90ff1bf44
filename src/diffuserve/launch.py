"""Composition root shared by `serve` and `generate`: args -> model path, plan, scheduler, engine.

This is the only module that knows every layer; each layer below it only knows its own inputs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.engine.engine import AsyncEngine, EngineConfig
from diffuserve.engine.metrics import BatchingStats, EngineMetrics
from diffuserve.engine.scheduler import BatchingConfig, DynamicBatcher
from diffuserve.pipelines.base import Pipeline

logger = logging.getLogger("diffuserve")


def resolve_model_path(args: ServerArgs) -> Path:
    """--model-path, or the embedded default model (built once into the cache)."""
    if args.model_path:
        return Path(args.model_path)
    from diffuserve.models.tiny import ensure_default_model

    path = ensure_default_model()
    logger.info("no --model-path: using the embedded default model at %s", path)
    return path


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_num_threads(num_threads: int | None, device: str) -> int | None:
    """Threads for torch's intra-op pool; None leaves torch's choice.

    On a CPU device the default is every core but one: the process also runs the HTTP event loop,
    JSON/base64 and image encoding, and OpenMP workers that lose their core to them stall at every
    small op (measured: the tiny model's singleton serving fell from 22 to 4 img/s with 2 threads on
    2 cores). An explicit OMP_NUM_THREADS is respected.
    """
    if num_threads is not None:
        return num_threads
    if os.environ.get("OMP_NUM_THREADS") or not device.startswith("cpu"):
        return None
    return max(1, (os.cpu_count() or 1) - 1)


def apply_num_threads(num_threads: int | None, device: str) -> None:
    threads = resolve_num_threads(num_threads, device)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        logger.info("torch intra-op threads: %d", threads)


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def build_batcher(args: ServerArgs) -> DynamicBatcher:
    rules = None
    if args.batching_config:
        from diffuserve.config.batching_rules import load_batching_rules

        rules = load_batching_rules(args.batching_config)
    config = BatchingConfig(
        mode=args.batching_mode,
        max_size=args.batching_max_size,
        delay_ms=args.batching_delay_ms,
        rules=rules,
    )
    config.validate()
    if config.mode == "continuous":
        from diffuserve.engine.step_scheduler import StepScheduler

        return StepScheduler(config, model_names=args.model_names)
    return DynamicBatcher(config, model_names=args.model_names)


@dataclass
class ResolvedDeployment:
    plan: Any
    """The DeploymentPlan."""
    device_budget_bytes: int | None
    """Free device memory the permanent residency sets must fit in (None on a CPU host)."""


def resolve_deployment(deployment: Any, model_path: Path, *, model_id: str | None, dtype: str | None,
                       hardware: Any) -> Any:
    """The plan for a checkpoint from JSON and safetensors headers only (no weights loaded)."""
    from diffuserve.config.deployment import resolve
    from diffuserve.config.model_profiles import profile_from_checkpoint

    profile = profile_from_checkpoint(model_path, model_id=model_id, load_dtype=dtype)
    return resolve(deployment, hardware, profile)


def plan_deployment(args: ServerArgs, model_path: Path, device: str) -> ResolvedDeployment:
    """Resolve and log the deployment plan for this machine."""
    from diffuserve.config.deployment import DeploymentArgs, format_plan
    from diffuserve.hardware import detect_hardware

    hardware = detect_hardware(device)
    plan = resolve_deployment(args.deployment or DeploymentArgs(), model_path, model_id=args.model_id,
                              dtype=resolve_dtype(args.dtype, device), hardware=hardware)
    logger.info("deployment plan:\n%s", format_plan(plan))
    from diffuserve.runtime.compile import check_executable

    check_executable(plan)
    budget = hardware.min_free_bytes(plan.num_gpus) if hardware.gpus else None
    return ResolvedDeployment(plan, budget)


def load_serving_pipeline(args: ServerArgs, model_path: Path, device: str, deployment: ResolvedDeployment,
                          metrics: EngineMetrics | None) -> Pipeline:
    """Load the pipeline, attach residency from the plan, and (operator-only) fault injection."""
    from diffuserve.engine.faults import maybe_inject_faults
    from diffuserve.models.loader import load_pipeline

    # To host: the residency manager below moves resident components to the device and leaves offloaded ones
    # on the host, so a model that fits only when offloaded still loads.
    pipeline = load_pipeline(
        model_path, model_id=args.model_id, backend=args.backend, device=device,
        dtype=resolve_dtype(args.dtype, device), placement="host",
    )
    if pipeline.components:
        import torch

        from diffuserve.runtime.ledger import TransferLedger
        from diffuserve.runtime.residency import build_residency

        ledger = TransferLedger()
        if metrics is not None:
            ledger.forward_to(metrics)
        pipeline.residency = build_residency(deployment.plan, pipeline.components, device=torch.device(device),
                                             ledger=ledger, device_budget_bytes=deployment.device_budget_bytes)
    from diffuserve.runtime.compile import apply_compile

    apply_compile(pipeline.components, deployment.plan)
    return maybe_inject_faults(pipeline)


def build_engine(args: ServerArgs) -> tuple[AsyncEngine, EngineMetrics, dict | None]:
    """Everything `serve` needs except HTTP. The model loads in the engine's thread (after HTTP is up)."""
    args.validate()
    model_path = resolve_model_path(args)
    device = resolve_device(args.device)
    deployment = plan_deployment(args, model_path, device)
    apply_num_threads(args.num_threads, device)
    metrics = EngineMetrics()
    if device.startswith("cuda"):
        metrics.watch_cuda_memory(device)
    scheduler = build_batcher(args)
    stats = BatchingStats(metrics, log_enabled=args.enable_batching_metrics)

    def load() -> Pipeline:
        pipeline = load_serving_pipeline(args, model_path, device, deployment, metrics)
        scheduler.supports_batching = pipeline.supports_batching
        if hasattr(scheduler, "supports_continuous"):  # --batching-mode continuous
            scheduler.supports_continuous = pipeline.supports_continuous
        return pipeline

    engine = AsyncEngine(
        load,
        scheduler,
        config=EngineConfig(
            max_queue_size=args.max_queue_size,
            request_timeout_s=args.request_timeout_s,
            enable_warmup=args.enable_warmup,
            warmup_steps=args.warmup_steps,
            warmup_resolutions=[tuple(int(v) for v in r.lower().split("x")) for r in deployment.plan.warmup_resolutions],
        ),
        metrics=metrics,
        batching_stats=stats,
        model_name=args.public_model_name,
    )
    return engine, metrics, deployment.plan.to_dict()
