"""Composition root shared by `serve` and `generate`: args -> model path, plan, scheduler, executor, engine.

This (with the rest of launch/) is the only module that knows every layer; each layer below it only knows its own
inputs. One rank's set-up is launch/setup.py; the ranks without HTTP are launch/follower.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.engine.engine import AsyncEngine
from diffuserve.engine.metrics import BatchingStats, EngineMetrics
from diffuserve.engine.scheduler import RequestLevelScheduler
from diffuserve.engine.step_scheduler import StepScheduler
from diffuserve.errors import ConfigError
from diffuserve.executor.base import InProcessExecutor
from diffuserve.launch.follower import serve_rank
from diffuserve.launch.ranks import (
    LaunchInfo,
    connect,
    launch_info,
    plan_num_gpus,
    rank_description,
    spawn_local_ranks,
)
from diffuserve.launch.setup import RankSetup, load_rank_pipeline, prepare_rank
from diffuserve.pipelines.serving import ServingPipeline

logger = logging.getLogger("diffuserve")


def build_batcher(args: ServerArgs, slots: int = 1) -> RequestLevelScheduler | StepScheduler:
    """The scheduler of the configured batching mode (`slots`: replicas that run batches at once)."""
    config = args.batching.with_rules()  # the scheduler validates it
    if args.lora.enabled:  # a batch's (or group's) adapters must fit the device slots at once (lora/registry.py)
        config = replace(config, max_adapters=args.lora.max_loras)
    warning = config.never_merges()
    if warning is not None:
        logger.warning("%s", warning)
    if config.mode == "continuous":
        return StepScheduler(config, model_names=args.model_names)
    return RequestLevelScheduler(config, model_names=args.model_names, slots=slots)


def _multi_rank_executor(args: ServerArgs, info: LaunchInfo, setup: RankSetup, metrics: EngineMetrics | None) -> Any:
    """Rank 0's executor: start this host's other ranks now; join them and load in the engine's thread."""
    from diffuserve.executor.channel import StoreChannel
    from diffuserve.executor.multirank import MultiRankExecutor
    from diffuserve.executor.protocol import RankLink
    from diffuserve.executor.topology import Topology, build_groups

    plan = setup.deployment.plan
    if args.batching.mode == "continuous" and plan.dp_size > 1:
        raise ConfigError(
            f"--batching-mode continuous runs one denoise group, on one replica; --dp-size {plan.dp_size} "
            "(or ranks no parallel degree uses) needs dynamic batching, or give degrees that fill "
            "--num-gpus.",
            param="batching_mode",
        )
    topology = Topology.from_plan(plan, rank=0, local_rank=0)
    children = spawn_local_ranks(args, info, serve_rank)
    logger.info(
        "ranks: %d over %d host(s); %d replica(s) of %d rank(s); rank 0 serves HTTP",
        plan.num_gpus,
        args.dist.nnodes,
        plan.dp_size,
        plan.ranks_per_replica,
    )

    def join() -> tuple[StoreChannel, Any]:
        store, _ = connect(info, setup.device, args.dist.dist_timeout_s)
        channel = StoreChannel(store)
        RankLink(channel).publish_rank(0, rank_description(info, setup.device))
        return channel, build_groups(topology, "cuda" if setup.device.startswith("cuda") else "cpu")

    return MultiRankExecutor(
        topology,
        connect=join,
        load_local=lambda groups: load_rank_pipeline(args, setup, groups, metrics),
        children=children,
        heartbeat_timeout_s=args.dist.dist_heartbeat_timeout_s,
        timeout_s=args.dist.dist_timeout_s,
        observe_call=metrics.observe_rank_call if metrics is not None else None,
    )


def build_generate_engine(args: ServerArgs) -> AsyncEngine:
    """`generate`'s engine: serve's engine, scheduler and executor in this process (with several ranks, replica 0's
    ranks start here and follow its calls). No warm-up, queue limit or server deadline: the prompts are all there
    is, and `generate` has no flags for those. A rank fault ends the process (1)."""
    info = launch_info(args, plan_num_gpus(args))
    setup = prepare_rank(args, info, brief=True)  # a one-shot run: the plan in one line
    plan = setup.deployment.plan
    executor: Any
    if info is None:
        executor = InProcessExecutor(lambda: load_rank_pipeline(args, setup, None))
    else:
        if plan.dp_size > 1:
            raise ConfigError(
                f"generate runs its prompts on one replica; --dp-size {plan.dp_size} (or ranks no "
                "parallel degree uses) needs `serve`. Give degrees that fill --num-gpus.",
                param="dp_size",
            )
        executor = _multi_rank_executor(args, info, setup, None)

        def fault(message: str) -> None:
            logger.error("exiting: %s", message)
            executor.shutdown()
            os._exit(1)

        executor.on_fault = fault
    config = replace(args.engine, enable_warmup=False, max_queue_size=0, request_timeout_s=0.0)
    engine = AsyncEngine(executor, build_batcher(args), config=config, model_name=args.public_model_name)
    engine.ready_line = None  # nothing is served: "model loaded" is the last start-up line
    return engine


def build_engine(args: ServerArgs) -> tuple[AsyncEngine, EngineMetrics, dict | None]:
    """Everything `serve` needs except HTTP. The model loads in the engine's thread (after HTTP is up); with
    several ranks, this host's other ranks start here and everyone joins in the engine's thread."""
    info = launch_info(args, plan_num_gpus(args))
    setup = prepare_rank(args, info)
    metrics = EngineMetrics()
    if setup.device.startswith("cuda"):
        metrics.watch_cuda_memory(setup.device)
    plan = setup.deployment.plan
    scheduler = build_batcher(args, slots=plan.dp_size)
    stats = BatchingStats(metrics, log_enabled=args.batching.enable_metrics)
    executor: Any = None
    if info is not None:
        executor = _multi_rank_executor(args, info, setup, metrics)

    def load() -> ServingPipeline:
        return load_rank_pipeline(args, setup, None, metrics)

    engine = AsyncEngine(
        executor if executor is not None else InProcessExecutor(load),
        scheduler,
        config=replace(
            args.engine,
            warmup_resolutions=[tuple(int(v) for v in r.lower().split("x")) for r in plan.warmup_resolutions],
            activation_budget_bytes=plan.activation_memory_bytes,
        ),
        metrics=metrics,
        batching_stats=stats,
        model_name=args.public_model_name,
    )
    if executor is not None:
        executor.on_fault = engine.fail_rank
    return engine, metrics, plan.to_dict()
