"""One replica's ranks running the same pipeline calls in lockstep.

The replica's leader runs the batch (`worker.run_batch`) on a `ReplicaPipeline`: each pipeline call is first
posted to the replica's other ranks (a `CallMessage` through the store), then run locally; at every step
boundary the leader's stop decision is broadcast on the replica's gloo group (`StepSync`), so every rank stops
at the same step or none does. After a call every other rank acknowledges it; a rank that does not within
`--dist-timeout-s` (stuck in a collective its peers left) is a fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffuserve.executor.batch_runner import run_batch
from diffuserve.executor.channel import StoreChannel
from diffuserve.executor.messages import BatchEvent, BatchMessage, Progress
from diffuserve.executor.protocol import (
    BatchReport,
    CallMessage,
    RankLink,
    ReplicaLink,
    StepMessage,
)
from diffuserve.executor.topology import Topology
from diffuserve.pipelines.lanes import Lanes
from diffuserve.pipelines.results import BatchResult
from diffuserve.pipelines.serving import ServingPipeline
from diffuserve.sampling import SamplingParams

logger = logging.getLogger("diffuserve.executor")


class RankFault(RuntimeError):
    """A rank of the replica died, hung or fell out of step; the message names it."""


def _warmup_placement(pipeline: ServingPipeline, wanted: bool) -> Any:
    """The rank's own compile warm-up placement (`--offload-during-compile`) when its leader is in one."""
    return pipeline.residency.compile_warmup() if wanted else contextlib.nullcontext()


def _with_seed(params: SamplingParams) -> SamplingParams:
    """Every rank must draw the same noise: an unset seed is drawn once, on the leader."""
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbelow(2**31))


class StepSync:
    """The leader's stop decision at each step boundary, broadcast to the replica's other ranks."""

    def __init__(self, group: Any, leader: int, size: int):
        self.group, self.leader, self.size = group, leader, size

    def __call__(self, decision: bool) -> bool:
        if self.size == 1:
            return decision
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if decision else 0], dtype=torch.uint8)
        dist.broadcast(flag, src=self.leader, group=self.group)
        return bool(flag.item())


@dataclass
class ReplicaPipeline:
    """The leader's view of the replica: `run` has Pipeline.run's signature and runs the call on every rank."""

    pipeline: ServingPipeline
    """This (leader) rank's serving pipeline."""
    channel: StoreChannel
    """The store channel."""
    topology: Topology
    """The leader's topology."""
    timeout_s: float
    """How long the other ranks may take to acknowledge a finished call."""
    sync: StepSync | None = None
    """The replica's step-boundary broadcast (None: a replica of one rank)."""
    is_alive: Callable[[], bool] = lambda: True
    """False once a fault was declared (waits give up)."""
    also_stop: Callable[[], bool] = lambda: False
    """An extra stop condition of the running batch (a remote leader: rank 0 posted its cancel)."""
    observe: Callable[[float, float], None] | None = None
    """observe(delivery_s, straggle_s) per call: how long the call message took to reach the slowest other rank,
    and how long the leader waited for their acknowledgements after its own part (the per-call overhead)."""
    _seq: int = field(default=0, init=False)
    _link: ReplicaLink = field(init=False)
    _unsent_starts: list[tuple[tuple[str, SamplingParams], ...]] = field(default_factory=list, init=False)
    _sent: set[str] = field(default_factory=set, init=False)
    _dropped: set[str] = field(default_factory=set, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _conds: Any = field(default=None, init=False)
    """The group's stacked conditioning across continuous steps (`step_batch.GroupConds`, made on first step)."""

    def __post_init__(self) -> None:
        self._link = ReplicaLink(self.channel, self.topology.replica)

    @property
    def lanes(self) -> Lanes | None:
        """The leader's side lanes: the other ranks denoise, only the leader decodes (in its lane)."""
        return self.pipeline.lanes

    @property
    def output_kind(self) -> str:
        return self.pipeline.output_kind

    def decode_batch(self, denoised: Any) -> BatchResult:
        """The leader's decode of a call all ranks denoised (`run_to_latents`)."""
        return self.pipeline.decode_batch(denoised)

    def shutdown_followers(self) -> None:
        t = self.topology
        for rank in t.replica_ranks():
            if rank != t.rank:
                self._link.post_call(rank, CallMessage(seq=self._seq, kind="shutdown"))

    # -- continuous batching: the StepRunner of executor/base.py, on every rank of the replica ----------------
    def start(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[Any]:
        """Start joining requests here; the other ranks start the same group with the next step (any thread)."""
        from diffuserve.pipelines import step_batch

        group = tuple((rid, _with_seed(params)) for rid, params in requests)
        results = step_batch.start_group(self.pipeline.served, [params for _, params in group])  # type: ignore[arg-type]
        with self._lock:
            self._unsent_starts.append(group)
        return results

    def drop(self, request_id: str) -> None:
        """A request left the group: the other ranks free its rows with the next step (once they started it)."""
        with self._lock:
            self._dropped.add(request_id)

    def step(self, rows: Sequence[tuple[str, Any]]) -> None:
        """One denoising step of the group on every rank, the rows stacked in the same order everywhere."""
        from diffuserve.pipelines import step_batch

        ids = [rid for rid, _ in rows]
        with self._lock:
            starts, self._unsent_starts = tuple(self._unsent_starts), []
            self._sent.update(rid for group in starts for rid, _ in group)
            drops = tuple(rid for rid in self._dropped if rid in self._sent)
            self._sent.difference_update(drops)
            self._dropped.difference_update(drops)
        seq, peers = self._next_seq()
        message = StepMessage(seq=seq, starts=starts, rows=tuple(ids), drops=drops, posted_at=time.time())
        for rank in peers:
            self._link.post_call(rank, message)
        try:
            if self._conds is None:
                self._conds = step_batch.GroupConds()
            step_batch.denoise_step(self.pipeline.served, [state for _, state in rows], self._conds)  # type: ignore[arg-type]
        finally:
            self._collect_acks(seq, peers, time.monotonic())

    def _next_seq(self) -> tuple[int, list[int]]:
        t = self.topology
        seq = self._seq
        self._seq += 1
        return seq, [r for r in t.replica_ranks() if r != t.rank]

    def _collect_acks(self, seq: int, peers: list[int], finished: float) -> None:
        t, delivery = self.topology, 0.0
        for rank in peers:
            try:
                ack = self._link.receive_ack(seq, rank, self.is_alive, self.timeout_s)
            except Exception as exc:
                raise RankFault(
                    f"rank {rank} did not finish call {seq} of replica {t.replica} within "
                    f"{self.timeout_s:.0f}s of rank {t.rank} ({exc})"
                ) from exc
            status, delivered = ack
            delivery = max(delivery, delivered)
            if status != "ok":
                logger.warning("rank %d: call %d: %s", rank, seq, status)
        if peers and self.observe is not None:
            self.observe(delivery, time.monotonic() - finished)

    # -- request-level batches ---------------------------------------------------------------------------
    def run(self, batch: Sequence[SamplingParams], **hooks: Any) -> BatchResult:
        return self._call(batch, hooks, latents_only=False)

    def run_to_latents(self, batch: Sequence[SamplingParams], **hooks: Any) -> Any:
        """Decode overlap (executor/batch_runner.py): every rank denoises, only the leader decodes (in its lane)."""
        return self._call(batch, hooks, latents_only=True)

    def _call(self, batch: Sequence[SamplingParams], hooks: dict[str, Any], *, latents_only: bool) -> Any:
        seq, peers = self._next_seq()
        batch = [_with_seed(p) for p in batch]
        warming = self.pipeline.residency.in_compile_warmup
        message = CallMessage(
            seq=seq,
            kind="call",
            params=tuple(batch),
            posted_at=time.time(),
            compile_warmup=warming,
            latents_only=latents_only,
        )
        for rank in peers:  # one key per reader: a read removes its key
            self._link.post_call(rank, message)
        local_stop = hooks.get("should_stop")

        def should_stop() -> bool:  # every rank asks at the same step boundaries; the leader's answer wins
            decision = bool(local_stop is not None and local_stop()) or self.also_stop()
            return self.sync(decision) if self.sync is not None else decision

        hooks["should_stop"] = should_stop
        try:
            if latents_only:
                return self.pipeline.run_to_latents(batch, **hooks)
            return self.pipeline.run(batch, **hooks)
        finally:
            self._collect_acks(seq, peers, time.monotonic())


def follow_calls(
    pipeline: ServingPipeline, channel: StoreChannel, topology: Topology, sync: StepSync, stop: threading.Event
) -> None:
    """A non-leader rank: run every pipeline call (or continuous step) its leader posts, until a shutdown call."""
    from diffuserve.pipelines import step_batch

    seq, link = 0, ReplicaLink(channel, topology.replica)
    states: dict[str, Any] = {}  # continuous batching: each group request's rows on this rank
    conds = step_batch.GroupConds()  # ... and the group's stacked conditioning, across steps
    while True:
        message = link.receive_call(seq, topology.rank, keep_waiting=lambda: not stop.is_set())
        if message.kind == "shutdown":
            RankLink(channel).say_bye(topology.rank)
            return
        delivered = max(0.0, time.time() - message.posted_at)
        try:
            if isinstance(message, StepMessage):
                for group in message.starts:
                    started = step_batch.start_group(pipeline.served, [p for _, p in group])  # type: ignore[arg-type]
                    states.update(
                        (rid, rows)
                        for (rid, _), rows in zip(group, started, strict=True)
                        if not isinstance(rows, Exception)
                    )
                for rid in message.drops:
                    states.pop(rid, None)
                step_batch.denoise_step(pipeline.served, [states[rid] for rid in message.rows], conds)  # type: ignore[arg-type]
            else:
                run = pipeline.run_to_latents if message.latents_only else pipeline.run
                with _warmup_placement(pipeline, message.compile_warmup):
                    run(list(message.params), should_stop=lambda: sync(False))
            ack = "ok"
        except Exception as exc:  # the leader decides what the batch's answer is; this rank reports
            logger.exception("pipeline call %d failed on rank %d", seq, topology.rank)
            ack = f"failed on rank {topology.rank}: {type(exc).__name__}: {exc}"
        link.post_ack(seq, topology.rank, (ack, delivered))
        seq += 1


@dataclass
class _StoreProgress:
    """A remote leader's `BatchEvents`: progress goes to the store for rank 0 to relay; rank 0's cancel arrives
    through `ReplicaPipeline.also_stop`, so no request reads as cancelled here."""

    link: ReplicaLink
    seq: int

    def emit(self, event: BatchEvent) -> None:
        if isinstance(event, Progress):
            self.link.report_progress(self.seq, event.step, event.num_steps)

    def is_cancelled(self, request_id: str) -> bool:
        return False


def lead_batches(
    replica_pipeline: ReplicaPipeline, channel: StoreChannel, topology: Topology, stop: threading.Event
) -> None:
    """The leader of a replica other than rank 0's: run each batch rank 0 posts and post its report back."""
    seq, link = 0, ReplicaLink(channel, topology.replica)
    while True:
        message: BatchMessage = link.receive_batch(seq, keep_waiting=lambda: not stop.is_set())
        if message.kind == "shutdown":
            replica_pipeline.shutdown_followers()
            RankLink(channel).say_bye(topology.rank)
            return
        replica_pipeline.also_stop = lambda seq=seq: link.cancelled(seq)
        with _warmup_placement(replica_pipeline.pipeline, message.compile_warmup):
            outcome = run_batch(replica_pipeline, message, _StoreProgress(link, seq))
        link.post_report(BatchReport.of(seq, outcome))  # rank 0 removes the batch's other keys
        seq += 1
