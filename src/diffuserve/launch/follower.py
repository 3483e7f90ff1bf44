"""A rank that serves no HTTP: join the group, load its share of the model, follow until shutdown.

Every rank but global rank 0 runs `serve_rank`: started as a child process by its host's first process
(`ranks.spawn_local_ranks(..., entry=serve_rank)`), by torchrun, or as the first process of a host other than
node 0 (`serve_other_node`). A replica's leader runs rank 0's batches (`replica.lead_batches`); every other rank
runs its leader's pipeline calls (`replica.follow_calls`).
"""

from __future__ import annotations

import logging
import signal
import threading

from diffuserve.config.server_args import ServerArgs
from diffuserve.launch.ranks import (
    LaunchInfo,
    configure_rank_logging,
    connect,
    launch_info,
    plan_num_gpus,
    rank_description,
    spawn_local_ranks,
    start_heartbeat,
)
from diffuserve.launch.setup import load_rank_pipeline, prepare_rank

logger = logging.getLogger("diffuserve.ranks")


def serve_rank(args: ServerArgs, info: LaunchInfo) -> int:
    """A rank that does not serve HTTP: join, load its share, follow until shutdown. Returns the exit code."""
    from diffuserve.executor.channel import ChannelClosed, StoreChannel
    from diffuserve.executor.protocol import RankLink
    from diffuserve.executor.replica import ReplicaPipeline, StepSync, follow_calls, lead_batches
    from diffuserve.executor.topology import Topology, build_groups

    configure_rank_logging(args, info.rank)
    ranks: RankLink | None = None
    try:
        setup = prepare_rank(args, info, log_plan=False)
        store, _ = connect(info, setup.device, args.dist.dist_timeout_s)
        channel = StoreChannel(store)
        ranks = RankLink(channel)
        ranks.publish_rank(info.rank, rank_description(info, setup.device))
        start_heartbeat(lambda link=ranks: link.beat(info.rank), info.rank)
        topology = Topology.from_plan(setup.deployment.plan, rank=info.rank, local_rank=info.local_rank)
        groups = build_groups(topology, "cuda" if setup.device.startswith("cuda") else "cpu")
        pipeline = load_rank_pipeline(args, setup, groups)
        sync = StepSync(groups.control, topology.leader, topology.ranks_per_replica)
        stop = threading.Event()
        logger.info(
            "rank %d ready (replica %d, %s)",
            info.rank,
            topology.replica,
            "leader" if topology.is_leader else f"follows rank {topology.leader}",
        )
        # From now on rank 0 stops this rank after its drain (torchrun and a terminal signal every rank at once):
        # the signal itself would cut this rank's part of the batches being drained.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
        if topology.is_leader:
            lead_batches(
                ReplicaPipeline(pipeline, channel, topology, args.dist.dist_timeout_s, sync=sync),
                channel,
                topology,
                stop,
            )
        else:
            follow_calls(pipeline, channel, topology, sync, stop)
        logger.info("rank %d: shutdown", info.rank)
        return 0
    except ChannelClosed as exc:
        logger.error("rank %d: %s; exiting", info.rank, exc)
        return 1
    except Exception as exc:
        logger.exception("rank %d failed", info.rank)
        if ranks is not None:
            try:
                ranks.report_fault(info.rank, f"{type(exc).__name__}: {exc}")
            except Exception:
                pass
        return 1


def serve_other_node(args: ServerArgs) -> int:
    """`serve` on a host other than node 0 (or a torchrun rank other than 0): this host's ranks, no HTTP."""
    info = launch_info(args, plan_num_gpus(args))
    assert info is not None
    children = spawn_local_ranks(args, info, serve_rank)
    code = serve_rank(args, info)
    for child in children.values():
        child.join(10)
        if child.exitcode is None:
            child.kill()
    return code
