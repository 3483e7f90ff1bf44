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
from diffuserve.errors import ConfigError
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


def build_batcher(args: ServerArgs, slots: int = 1) -> DynamicBatcher:
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
    return DynamicBatcher(config, model_names=args.model_names, slots=slots)


@dataclass
class ResolvedDeployment:
    plan: Any
    """The DeploymentPlan."""
    device_budget_bytes: int | None
    """Free device memory the permanent residency sets must fit in (None on a CPU host)."""


def resolve_deployment(deployment: Any, model_path: Path, *, model_id: str | None, dtype: str | None,
                       hardware: Any, hosts: int = 1, backend: str = "auto") -> Any:
    """The plan for a checkpoint from JSON and safetensors headers only (no weights loaded), for the backend
    `--backend` picks (so `plan` and start-up refuse the same parallel modes)."""
    from diffuserve.config.deployment import resolve
    from diffuserve.config.model_profiles import profile_from_checkpoint

    profile = profile_from_checkpoint(model_path, model_id=model_id, load_dtype=dtype, backend=backend)
    return resolve(deployment, hardware, profile, hosts=hosts)


def plan_deployment(args: ServerArgs, model_path: Path, device: str, *, log_plan: bool = True) -> ResolvedDeployment:
    """Resolve and log the deployment plan for this machine."""
    from diffuserve.config.deployment import DeploymentArgs, format_plan
    from diffuserve.hardware import detect_hardware

    hardware = detect_hardware(device)
    from diffuserve.launch_ranks import hosts_of

    plan = resolve_deployment(args.deployment or DeploymentArgs(), model_path, model_id=args.model_id,
                              dtype=resolve_dtype(args.dtype, device), hardware=hardware, hosts=hosts_of(args),
                              backend=args.backend)
    if log_plan:
        logger.info("deployment plan:\n%s", format_plan(plan))
    from diffuserve.runtime.compile import check_executable

    check_executable(plan)
    budget = hardware.min_free_bytes(plan.num_gpus // hosts_of(args)) if hardware.gpus else None
    return ResolvedDeployment(plan, budget)


def load_serving_pipeline(args: ServerArgs, model_path: Path, device: str, deployment: ResolvedDeployment,
                          metrics: EngineMetrics | None, groups: Any = None) -> Pipeline:
    """Load the pipeline, attach residency and (on several ranks, `groups`) the plan's parallel modes, compile,
    and (operator-only) fault injection."""
    from diffuserve.engine.faults import maybe_inject_faults
    from diffuserve.models.loader import load_pipeline

    # To host: the residency manager below moves resident components to the device and leaves offloaded ones
    # on the host, so a model that fits only when offloaded still loads.
    pipeline = load_pipeline(
        model_path, model_id=args.model_id, backend=args.backend, device=device,
        dtype=resolve_dtype(args.dtype, device), placement="host",
    )
    applied: list[str] = []
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
        pipeline.residency = build_residency(deployment.plan, pipeline.components, device=torch.device(device),
                                             ledger=ledger, device_budget_bytes=deployment.device_budget_bytes)
    if groups is not None:
        from diffuserve.parallel.apply import apply_parallelism

        applied += apply_parallelism(pipeline, deployment.plan, groups)
        if applied:
            logger.info("parallel modes: %s", ", ".join(applied))
    from diffuserve.runtime.compile import apply_compile

    apply_compile(pipeline.components, deployment.plan)
    return maybe_inject_faults(pipeline)


@dataclass
class RankSetup:
    """What every rank resolves the same way before loading: the checkpoint, its device and the plan."""

    model_path: Path
    """The checkpoint folder."""
    device: str
    """This rank's device (cuda:{local_rank} or cpu)."""
    deployment: ResolvedDeployment
    """The plan (identical on every rank: same flags, same checkpoint headers)."""


def resolve_plan_num_gpus(args: ServerArgs) -> int:
    return (args.deployment.num_gpus if args.deployment is not None else None) or 1


def prepare_rank(args: ServerArgs, info: Any, *, log_plan: bool = True) -> RankSetup:
    """Validate, find the checkpoint, resolve the plan for this rank's device, size its thread pool."""
    args.validate()
    model_path = resolve_model_path(args)
    device = resolve_device(args.device)
    if info is not None:
        device = info.device(device)
    deployment = plan_deployment(args, model_path, device, log_plan=log_plan)
    apply_num_threads(args.num_threads, device, info.local_world_size if info is not None else 1)
    return RankSetup(model_path, device, deployment)


def load_rank_pipeline(args: ServerArgs, setup: RankSetup, groups: Any, metrics: EngineMetrics | None = None) -> Pipeline:
    """One rank's pipeline: loaded, with residency and this rank's share of the plan's parallel modes."""
    return load_serving_pipeline(args, setup.model_path, setup.device, setup.deployment, metrics, groups)


def _multi_rank_executor(args: ServerArgs, info: Any, setup: RankSetup, metrics: EngineMetrics) -> Any:
    """Rank 0's executor: start this host's other ranks now; join them and load in the engine's thread."""
    from diffuserve.executor.channel import StoreChannel
    from diffuserve.executor.multirank import MultiRankExecutor
    from diffuserve.executor.topology import Topology, build_groups
    from diffuserve.launch_ranks import connect, rank_description, spawn_local_ranks

    plan = setup.deployment.plan
    if args.batching_mode == "continuous" and plan.dp_size > 1:
        raise ConfigError(f"--batching-mode continuous runs one denoise group, on one replica; --dp-size {plan.dp_size} "
                          "(or ranks no parallel degree uses) needs dynamic batching, or give degrees that fill "
                          "--num-gpus.", param="batching_mode")
    topology = Topology.from_plan(plan, rank=0, local_rank=0)
    children = spawn_local_ranks(args, info)
    logger.info("ranks: %d over %d host(s); %d replica(s) of %d rank(s); rank 0 serves HTTP",
                plan.num_gpus, args.nnodes, plan.dp_size, plan.ranks_per_replica)

    def join() -> tuple[StoreChannel, Any]:
        store, _ = connect(info, setup.device, args.dist_timeout_s)
        channel = StoreChannel(store)
        channel.publish_rank(0, rank_description(info, setup.device))
        return channel, build_groups(topology, "cuda" if setup.device.startswith("cuda") else "cpu")

    return MultiRankExecutor(topology, connect=join, load_local=lambda groups: load_rank_pipeline(args, setup, groups, metrics),
                             children=children, heartbeat_timeout_s=args.dist_heartbeat_timeout_s,
                             timeout_s=args.dist_timeout_s,
                             observe_call=metrics.observe_rank_call if metrics is not None else None)


def open_pipeline(args: ServerArgs) -> tuple[Any, Any]:
    """`generate`'s pipeline: this process's own, or (with several ranks) replica 0's, whose calls run on every
    rank of it. Returns (pipeline, close); close() stops the other ranks. A rank fault ends the process (1)."""
    from diffuserve.launch_ranks import launch_info

    info = launch_info(args, resolve_plan_num_gpus(args))
    setup = prepare_rank(args, info)
    if info is None:
        return load_rank_pipeline(args, setup, None), lambda: None
    if setup.deployment.plan.dp_size > 1:
        raise ConfigError(f"generate runs its prompts on one replica; --dp-size {setup.deployment.plan.dp_size} "
                          "(or ranks no parallel degree uses) needs `serve`. Give degrees that fill --num-gpus.",
                          param="dp_size")
    executor = _multi_rank_executor(args, info, setup, None)

    def fault(message: str) -> None:
        logger.error("exiting: %s", message)
        executor.shutdown()
        os._exit(1)

    executor.on_fault = fault
    executor.load()
    return executor.local, executor.shutdown


def build_engine(args: ServerArgs) -> tuple[AsyncEngine, EngineMetrics, dict | None]:
    """Everything `serve` needs except HTTP. The model loads in the engine's thread (after HTTP is up); with
    several ranks, this host's other ranks start here and everyone joins in the engine's thread."""
    from diffuserve.launch_ranks import launch_info

    info = launch_info(args, resolve_plan_num_gpus(args))
    setup = prepare_rank(args, info)
    metrics = EngineMetrics()
    if setup.device.startswith("cuda"):
        metrics.watch_cuda_memory(setup.device)
    plan = setup.deployment.plan
    scheduler = build_batcher(args, slots=plan.dp_size)
    stats = BatchingStats(metrics, log_enabled=args.enable_batching_metrics)
    executor: Any = None
    if info is not None:
        executor = _multi_rank_executor(args, info, setup, metrics)

    def load() -> Pipeline:
        return load_rank_pipeline(args, setup, None, metrics)

    engine = AsyncEngine(
        executor if executor is not None else load,
        scheduler,
        config=EngineConfig(
            max_queue_size=args.max_queue_size,
            request_timeout_s=args.request_timeout_s,
            enable_warmup=args.enable_warmup,
            warmup_steps=args.warmup_steps,
            warmup_resolutions=[tuple(int(v) for v in r.lower().split("x")) for r in plan.warmup_resolutions],
        ),
        metrics=metrics,
        batching_stats=stats,
        model_name=args.public_model_name,
    )
    if executor is not None:
        executor.on_fault = engine.fail_rank
    return engine, metrics, plan.to_dict()
