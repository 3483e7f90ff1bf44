"""DistArgs: the `Distributed launch` flags: hosts, this host's index, the rendezvous and fault timeouts.

How many ranks there are is a deployment flag (`--num-gpus`, config/deployment.py); these say how the
ranks find each other and when a silent rank counts as a fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag

DIST_GROUP = "Distributed launch (several ranks, several hosts)"


@dataclass
class DistArgs:
    """Multi-host launch and rank fault detection."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate")

    nnodes: int = flag(
        1,
        "Hosts the --num-gpus ranks are spread over (each host runs --num-gpus / --nnodes ranks; start the same "
        "command on every host with its own --node-rank).",
        DIST_GROUP,
    )
    """Number of hosts."""
    node_rank: int = flag(
        0,
        "This host's index, 0 to --nnodes - 1. Only node 0 serves HTTP (its first rank hosts the engine).",
        DIST_GROUP,
    )
    """This host's index."""
    dist_init_addr: str | None = flag(
        None,
        "HOST:PORT of node 0 where every rank meets (a TCP store); required with --nnodes > 1. Default on one host: "
        "127.0.0.1 and a free port.",
        DIST_GROUP,
        metavar="HOST:PORT",
    )
    """Rendezvous address."""
    dist_heartbeat_timeout_s: float = flag(
        30.0,
        "A rank that sends no heartbeat for this long is declared hung: every in-flight request gets an error naming "
        "it, /health turns 503 and the server exits non-zero.",
        DIST_GROUP,
    )
    """Hung-rank detection bound."""
    dist_timeout_s: float = flag(
        600.0,
        "Timeout of the ranks' process groups and of a rank's answer to a finished pipeline call (a rank stuck that "
        "long in a collective is a fault).",
        DIST_GROUP,
    )
    """Collective / straggler timeout."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        check_flags(
            [
                (self.nnodes < 1, "--nnodes", f"{self.nnodes} must be >= 1"),
                (
                    not 0 <= self.node_rank < self.nnodes,
                    "--node-rank",
                    f"{self.node_rank} must be between 0 and --nnodes - 1 ({self.nnodes - 1})",
                ),
                (
                    self.nnodes > 1 and not self.dist_init_addr,
                    "--dist-init-addr",
                    "is required with --nnodes > 1: give HOST:PORT of node 0, the same on every host",
                ),
                (
                    self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr),
                    "--dist-init-addr",
                    f"{self.dist_init_addr!r} is not HOST:PORT",
                ),
                (
                    self.dist_heartbeat_timeout_s <= 0,
                    "--dist-heartbeat-timeout-s",
                    f"{self.dist_heartbeat_timeout_s} must be > 0",
                ),
                (self.dist_timeout_s <= 0, "--dist-timeout-s", f"{self.dist_timeout_s} must be > 0"),
            ]
        )


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
