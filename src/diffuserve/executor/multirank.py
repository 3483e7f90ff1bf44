"""Rank 0's executor over several ranks: replica 0 runs here (rank 0 is its leader), the other replicas' batches
go to their leaders through the store, and a monitor thread watches every rank's heartbeat.

Faults: a rank whose process exits, that reports a fault, or whose heartbeat stops for
`--dist-heartbeat-timeout-s` (killed, stopped, unreachable) is declared faulty: `on_fault(message naming it)`
is called once — the engine then answers every request with that message, /health turns 503 and the server
exits non-zero so the orchestrator restarts the group. Waits on a faulty group give up at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from diffuserve.executor.base import PipelineSteps, ReplicaState
from diffuserve.executor.batch_runner import BatchEvents, BatchOutcome, run_batch
from diffuserve.executor.channel import StoreChannel
from diffuserve.executor.messages import BatchMessage, Progress
from diffuserve.executor.monitor import RankMonitor
from diffuserve.executor.protocol import RankLink, ReplicaLink
from diffuserve.executor.replica import RankFault, ReplicaPipeline, StepSync
from diffuserve.executor.topology import Topology
from diffuserve.pipelines.serving import ServingPipeline
from diffuserve.sampling import SamplingParams

logger = logging.getLogger("diffuserve.executor")


class MultiRankExecutor:
    """Executor over `topology.world_size` ranks in `dp_size` replicas; this process is global rank 0."""

    multi_rank = True

    def __init__(
        self,
        topology: Topology,
        *,
        connect: Callable[[], tuple[StoreChannel, Any]],
        load_local: Callable[[Any], ServingPipeline],
        children: dict[int, Any],
        heartbeat_timeout_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        observe_call: Callable[[float, float], None] | None = None,
    ):
        self.topology = topology
        self._connect, self._load_local, self._children = connect, load_local, children
        self._heartbeat_timeout_s, self._timeout_s, self._clock = heartbeat_timeout_s, timeout_s, clock
        self._observe_call = observe_call
        self.replicas = [ReplicaState(r, topology.replica_ranks(r)) for r in range(topology.dp_size)]
        self.on_fault: Callable[[str], None] = lambda message: None
        """Set by the engine's owner: called once, from the monitor thread, when a rank fails."""
        self.channel: StoreChannel | None = None
        self._ranks: RankLink | None = None
        self._links: list[ReplicaLink] = []
        self.monitor: RankMonitor | None = None
        self.local: ReplicaPipeline | None = None
        self._sync: StepSync | None = None
        self._seq = [0] * topology.dp_size

    def describe_rank(self, rank: int) -> str:
        replica = rank // self.topology.ranks_per_replica
        return f"rank {rank} of {self.topology.world_size} (replica {replica})"

    def describe(self) -> dict[str, Any]:
        """/server_info's view: the topology and every rank's pid, host and device."""
        ranks = []
        for rank in range(self.topology.world_size):
            try:
                info = self._ranks.rank_info(rank) if self._ranks is not None else None
            except Exception:  # the store is gone with a faulty rank
                info = None
            ranks.append(info or {"rank": rank})
        t = self.topology
        return {
            "world_size": t.world_size,
            "dp_size": t.dp_size,
            "ranks_per_replica": t.ranks_per_replica,
            "cfg": t.cfg,
            "ulysses": t.ulysses,
            "ring": t.ring,
            "tp": t.tp,
            "ranks": ranks,
            "fault": self.monitor.fault if self.monitor is not None else None,
        }

    @property
    def alive(self) -> bool:
        return self.monitor is None or self.monitor.fault is None

    def load(self) -> ServingPipeline:
        """Join the group (the other ranks load at the same time), then load replica 0's share here."""
        self.channel, groups = self._connect()
        self._ranks = RankLink(self.channel)
        self._links = [ReplicaLink(self.channel, r) for r in range(self.topology.dp_size)]
        self.monitor = RankMonitor(
            self._ranks,
            self.topology.world_size,
            heartbeat_timeout_s=self._heartbeat_timeout_s,
            children=self._children,
            on_fault=self._fault,
            describe=self.describe_rank,
        )
        self.monitor.start()
        pipeline = self._load_local(groups)
        self._sync = StepSync(groups.control, 0, self.topology.ranks_per_replica)
        self.local = ReplicaPipeline(
            pipeline,
            self.channel,
            self.topology,
            self._timeout_s,
            sync=self._sync,
            is_alive=lambda: self.alive,
            observe=self._observe_call,
        )
        return pipeline

    def steps(self) -> PipelineSteps:
        """Continuous batching on replica 0's ranks (the only replica continuous mode runs with)."""
        assert self.local is not None, "load() first"
        return PipelineSteps(self.local.pipeline, ranks=self.local)

    def prefetch(self, params: SamplingParams, on_done: Callable[[int], None]) -> bool:
        """No text prefetch across ranks (every rank would have to encode the same texts at the same time)."""
        return False

    def _fault(self, rank: int, message: str) -> None:
        for state in self.replicas:
            if rank in state.ranks or rank < 0:
                state.failed = message
        self.on_fault(message)

    def execute(self, replica: int, message: BatchMessage, events: BatchEvents) -> BatchOutcome:
        if not self.alive:
            raise RankFault(self.monitor.fault if self.monitor else "the rank group is down")
        if replica == 0:
            assert self.local is not None and self._sync is not None
            return run_batch(self.local, message, events, clock=self._clock)
        return self._execute_remote(replica, message, events)

    def _execute_remote(self, replica: int, message: BatchMessage, events: BatchEvents) -> BatchOutcome:
        """Post the batch to the replica's leader; relay progress and cancellation until its report arrives."""
        link = self._links[replica]
        seq = self._seq[replica]
        self._seq[replica] += 1
        live = [
            (rid, p) for rid, p in zip(message.request_ids, message.params, strict=True) if not events.is_cancelled(rid)
        ]
        if not live:
            return BatchOutcome()
        started = self._clock()
        # A remote leader makes no previews and decodes in line (its report carries the outputs).
        link.post_batch(
            dataclasses.replace(
                message,
                seq=seq,
                kind="batch",
                request_ids=tuple(rid for rid, _ in live),
                params=tuple(p for _, p in live),
                previews=(),
                defer_decode=False,
            )
        )
        steps_seen, cancelled = 0, False
        while True:
            report = link.poll_report(seq)
            if report is not None:
                return BatchOutcome(**report.fields())
            if not self.alive:
                raise RankFault(self.monitor.fault if self.monitor else "the rank group is down")
            done, total = link.read_progress(seq)
            if done > steps_seen:
                for step in range(steps_seen, done):
                    events.emit(Progress(step, total))
            steps_seen = max(steps_seen, done)
            if not cancelled and all(events.is_cancelled(rid) for rid, _ in live):
                link.request_cancel(seq)
                cancelled = True
            time.sleep(0.005 if self._clock() - started < 1 else 0.02)

    def shutdown(self) -> None:
        """Tell every rank to leave its loop, then wait a little for local child processes and stop the rest."""
        if self.monitor is not None:
            self.monitor.stop()
        if self._ranks is not None and self.alive:
            try:
                if self.local is not None:
                    self.local.shutdown_followers()
                for replica in range(1, self.topology.dp_size):
                    self._links[replica].post_batch(BatchMessage(seq=self._seq[replica], kind="shutdown"))
                for rank in range(1, self.topology.world_size):  # the store must outlive their last read
                    self._ranks.wait_bye(rank, timeout_s=10)
            except Exception:  # the store may be gone with a faulty rank; the children are stopped below
                logger.warning("not every rank confirmed the shutdown; stopping this host's ranks", exc_info=True)
        deadline = time.monotonic() + 10
        for child in self._children.values():
            child.join(max(0.0, deadline - time.monotonic()))
            if child.exitcode is None:
                child.kill()
