"""The process topology of a multi-rank deployment (`--num-gpus N`, several hosts, or torchrun): no model code.

Roles: global rank 0 serves HTTP and hosts the engine (launch/root.py builds a MultiRankExecutor); every other
rank runs a follower (launch/follower.py): join the group, load its share of the model, then follow its
replica's leader (or, as a replica leader, rank 0's batches) until shutdown. Without torchrun, the first process
on each host starts that host's other ranks as child processes (`spawn`, running the entry point it is given);
under torchrun every rank is started by torchrun. Every rank meets at one TCP store: `--dist-init-addr`
(node 0), or 127.0.0.1 and a free port on one host.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import ConfigError

logger = logging.getLogger("diffuserve.ranks")

_HEARTBEAT_INTERVAL_S = 1.0
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchInfo:
    """How this process joins the ranks."""

    world_size: int
    """All ranks (= --num-gpus)."""
    rank: int
    """This process's global rank."""
    local_rank: int
    """Its index on this host."""
    local_world_size: int
    """Ranks on this host."""
    store_host: str
    """Host of the TCP store (node 0)."""
    store_port: int
    """Port of the TCP store."""
    torchrun: bool = False
    """Started by torchrun (which owns the processes and the store)."""

    def device(self, device: str) -> str:
        """This rank's device: cuda:{local_rank} on GPUs, the host otherwise."""
        return f"cuda:{self.local_rank}" if device.startswith("cuda") else "cpu"


def under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_ENV)


def hosts_of(args: ServerArgs) -> int:
    """Hosts the ranks run on: --nnodes, or under torchrun WORLD_SIZE / LOCAL_WORLD_SIZE."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return args.dist.nnodes


def is_serving_process(args: ServerArgs) -> bool:
    """Only global rank 0 serves HTTP: under torchrun RANK 0, otherwise the first process of node 0."""
    if under_torchrun():
        return int(os.environ["RANK"]) == 0
    return args.dist.node_rank == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def plan_num_gpus(args: ServerArgs) -> int:
    """The ranks the flags ask for (--num-gpus, 1 when unset), before any plan is resolved."""
    return (args.deployment.num_gpus if args.deployment is not None else None) or 1


def launch_info(args: ServerArgs, num_gpus: int) -> LaunchInfo | None:
    """None for a one-rank deployment; else how this (first-on-its-host, or torchrun) process joins."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.deployment is not None and args.deployment.num_gpus not in (None, world):
            raise ConfigError(
                f"--num-gpus {args.deployment.num_gpus} but torchrun started {world} ranks "
                f"(WORLD_SIZE); make them equal.",
                param="num_gpus",
            )
        return LaunchInfo(
            world_size=world,
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            store_host=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            torchrun=True,
        )
    if num_gpus == 1 and args.dist.nnodes == 1:
        return None
    if num_gpus % args.dist.nnodes:
        raise ConfigError(
            f"--num-gpus {num_gpus} is not a multiple of --nnodes {args.dist.nnodes}; every host runs "
            "--num-gpus / --nnodes ranks.",
            param="nnodes",
        )
    per_node = num_gpus // args.dist.nnodes
    if args.dist.dist_init_addr:
        host, _, port = args.dist.dist_init_addr.rpartition(":")
    else:
        host, port = "127.0.0.1", str(_free_port())
    return LaunchInfo(
        world_size=num_gpus,
        rank=args.dist.node_rank * per_node,
        local_rank=0,
        local_world_size=per_node,
        store_host=host.strip("[]"),
        store_port=int(port),
    )


def connect(info: LaunchInfo, device: str, timeout_s: float) -> tuple[Any, Any]:
    """Join the process group; returns (store, backend). NCCL for CUDA ranks, gloo on the host."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(info.local_rank)
    if info.torchrun:
        dist.init_process_group(backend, timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    else:
        store = dist.TCPStore(
            info.store_host,
            info.store_port,
            info.world_size,
            is_master=info.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        dist.init_process_group(
            backend, store=dist.PrefixStore("pg/", store), rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    return store, backend


RankEntry = Callable[[ServerArgs, LaunchInfo], int]
"""A rank's main function: (args, its LaunchInfo) -> exit code. Module-level, so a spawned child can unpickle it."""


def spawn_local_ranks(args: ServerArgs, info: LaunchInfo, entry: RankEntry) -> dict[int, Any]:
    """Start this host's other ranks as child processes running `entry`; returns global rank -> process.

    The entry point is an argument (launch/follower.py passes its `serve_rank`) so that the topology knows nothing
    of what a rank runs."""
    import multiprocessing

    if info.torchrun:
        return {}
    context = multiprocessing.get_context("spawn")
    children = {}
    for local_rank in range(1, info.local_world_size):
        child = dataclasses.replace(info, rank=info.rank + local_rank, local_rank=local_rank)
        process = context.Process(
            target=_child_main, args=(entry, args, child), name=f"diffuserve-rank{child.rank}", daemon=True
        )
        process.start()
        children[child.rank] = process
    return children


def _child_main(entry: RankEntry, args: ServerArgs, info: LaunchInfo) -> None:
    # A terminal's Ctrl-C reaches every process of the group: rank 0 drains and then stops the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os._exit(entry(args, info))


def rank_description(info: LaunchInfo, device: str) -> dict[str, Any]:
    """What /server_info shows of this rank."""
    return {
        "rank": info.rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "local_rank": info.local_rank,
        "device": device,
    }


def configure_rank_logging(args: ServerArgs, rank: int) -> None:
    """Every log line of a rank without HTTP names its rank."""
    logging.basicConfig(
        level=args.http.log_level.upper(),
        force=True,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )


def _heartbeat(beat: Callable[[], None], rank: int) -> None:
    """Beat every second; when the store is gone (rank 0 exited) this rank exits too."""
    while True:
        try:
            beat()
        except Exception:
            logger.error("rank %d: lost the rank-0 store; exiting", rank)
            os._exit(1)
        time.sleep(_HEARTBEAT_INTERVAL_S)


def start_heartbeat(beat: Callable[[], None], rank: int) -> None:
    """Call `beat()` every second from a daemon thread, for as long as this process lives (rank 0's monitor
    declares a rank whose beats stop hung)."""
    threading.Thread(target=_heartbeat, args=(beat, rank), name="diffuserve-heartbeat", daemon=True).start()
