"""Composition root shared by `serve` and `generate`: args -> model path, plan, scheduler, engine.

This is the only module that knows every layer; each layer below it only knows its own inputs.
"""

from __future__ import annotations

import logging
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
    return DynamicBatcher(config, model_names=args.model_names)


def plan_deployment(args: ServerArgs, model_path: Path, device: str) -> Any:
    """Resolve and log the deployment plan (pure; reads only JSON and safetensors headers)."""
    from diffuserve.config.deployment import DeploymentArgs, format_plan, resolve
    from diffuserve.config.model_profiles import profile_from_checkpoint
    from diffuserve.hardware import detect_hardware

    deployment = args.deployment or DeploymentArgs()
    plan = resolve(deployment, detect_hardware(device), profile_from_checkpoint(model_path))
    logger.info("deployment plan:\n%s", format_plan(plan))
    return plan


def load_serving_pipeline(args: ServerArgs, model_path: Path, device: str, plan: Any, metrics: EngineMetrics | None) -> Pipeline:
    """Load the pipeline, attach residency from the plan, and (operator-only) fault injection."""
    from diffuserve.engine.faults import maybe_inject_faults
    from diffuserve.models.loader import load_pipeline

    pipeline = load_pipeline(
        model_path, model_id=args.model_id, backend=args.backend, device=device,
        dtype=resolve_dtype(args.dtype, device),
    )
    if plan is not None and pipeline.components:
        import torch

        from diffuserve.runtime.ledger import TransferLedger
        from diffuserve.runtime.residency import build_residency

        ledger = TransferLedger()
        if metrics is not None:
            ledger.forward_to(metrics)
        pipeline.residency = build_residency(plan, pipeline.components, device=torch.device(device), ledger=ledger)
    return maybe_inject_faults(pipeline)


def build_engine(args: ServerArgs) -> tuple[AsyncEngine, EngineMetrics, dict | None]:
    """Everything `serve` needs except HTTP. The model loads in the engine's thread (after HTTP is up)."""
    args.validate()
    model_path = resolve_model_path(args)
    device = resolve_device(args.device)
    plan = plan_deployment(args, model_path, device)
    metrics = EngineMetrics()
    scheduler = build_batcher(args)
    stats = BatchingStats(metrics, log_enabled=args.enable_batching_metrics)

    def load() -> Pipeline:
        pipeline = load_serving_pipeline(args, model_path, device, plan, metrics)
        scheduler.supports_batching = pipeline.supports_batching
        return pipeline

    engine = AsyncEngine(
        load,
        scheduler,
        config=EngineConfig(
            max_queue_size=args.max_queue_size,
            request_timeout_s=args.request_timeout_s,
            enable_warmup=args.enable_warmup,
            warmup_steps=args.warmup_steps,
        ),
        metrics=metrics,
        batching_stats=stats,
        model_name=args.public_model_name,
    )
    return engine, metrics, plan.to_dict() if plan is not None else None
