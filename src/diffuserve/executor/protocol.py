"""The multi-rank protocol: every store key, every message type, and the typed links each role talks through.

Three roles share one TCP store (executor/channel.py is the transport; no other module touches the store):

- **rank 0** (the engine, executor/multirank.py) posts a replica's batches to its leader (`ReplicaLink.post_batch`),
  relays the leader's step progress (`read_progress`) and the engine's cancel (`request_cancel`) until the report
  arrives (`poll_report`), and watches every rank (`RankLink`: heartbeats, fault reports);
- a **replica leader** (rank 0 for replica 0; `replica.lead_batches` for the others) receives batches
  (`receive_batch`), reports progress (`report_progress`), stops on `cancelled`, answers with `post_report`, and
  posts every pipeline call or continuous step to its other ranks (`post_call`), then collects their acks
  (`receive_ack`);
- a **follower** (`replica.follow_calls`) receives its leader's calls (`receive_call`) and acknowledges each one
  (`post_ack`).

Every rank publishes what /server_info shows of it, beats its heartbeat, reports its own failure and, leaving on a
shutdown message, says bye so that rank 0 keeps the store up until everyone has read it (`RankLink`).

The messages travel through the store, never through a collective, so a rank waiting for work is not blocked inside
a collective (STACK.md's idle trap) and a dead peer shows up as a missing heartbeat instead of a hang. Every
message key is removed by its reader; the counters and flags of a batch are removed by rank 0 with its report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from diffuserve.errors import DiffuserveError, GenerationError, RequestCancelledError
from diffuserve.executor.channel import StoreChannel
from diffuserve.executor.messages import BatchMessage
from diffuserve.pipelines.results import RequestOutput
from diffuserve.sampling import SamplingParams


# -- keys (the only place their names are spelled) ----------------------------------------------------------------
def _batch_key(replica: int, seq: int) -> str:
    return f"batch/{replica}/{seq}"


def _report_key(replica: int, seq: int) -> str:
    return f"report/{replica}/{seq}"


def _progress_key(replica: int, seq: int) -> str:
    """A counter: steps the batch's pipeline calls have finished (atomic, read with add(0))."""
    return f"progress/{replica}/{seq}"


def _progress_total_key(replica: int, seq: int) -> str:
    return f"progress/{replica}/{seq}/total"


def _cancel_key(replica: int, seq: int) -> str:
    return f"cancel/{replica}/{seq}"


def _call_key(replica: int, seq: int, rank: int) -> str:
    return f"call/{replica}/{seq}/{rank}"


def _ack_key(replica: int, seq: int, rank: int) -> str:
    return f"ack/{replica}/{seq}/{rank}"


def _bye_key(rank: int) -> str:
    return f"bye/{rank}"


def _rank_key(rank: int) -> str:
    return f"rank/{rank}"


def _heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def _fault_key(rank: int) -> str:
    return f"fault/{rank}"


# -- messages ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallMessage:
    """One pipeline call for every rank of a replica: the replica's leader -> its other ranks."""

    seq: int
    """Sequence number of the call on its replica."""
    kind: Literal["call", "shutdown"]
    """call: run `params` as one pipeline call; shutdown: leave the loop."""
    params: tuple[SamplingParams, ...] = ()
    """The call's rows, exactly as the leader runs them."""
    posted_at: float = 0.0
    """time.time() when the leader posted it (the receiver reports how long delivery took)."""
    compile_warmup: bool = False
    """The leader runs it inside its residency's compile_warmup() (--offload-during-compile): so do the others."""
    latents_only: bool = False
    """The leader stops before the decode (it decodes in its decode lane, beside the next batch): the other ranks
    skip the decode, whose output only the leader answers with."""


@dataclass(frozen=True)
class StepMessage:
    """One continuous-batching denoising step for every rank of a replica (the same sequence as CallMessage)."""

    seq: int
    """Sequence number on its replica (shared with pipeline calls)."""
    starts: tuple[tuple[tuple[str, SamplingParams], ...], ...] = ()
    """Groups of requests the leader started together since the last step, each as (request id, params) pairs;
    every rank starts each group the same way (shared encoder calls), so its rows equal the leader's."""
    rows: tuple[str, ...] = ()
    """The step's requests, in the order their rows are stacked."""
    drops: tuple[str, ...] = ()
    """Requests that left (finished, cancelled, failed): their rows are freed (after `starts` is applied)."""
    posted_at: float = 0.0
    """time.time() when the leader posted it."""
    kind: Literal["step"] = "step"


@dataclass(frozen=True)
class ErrorInfo:
    """A request's error, picklable whatever the exception class's constructor takes."""

    kind: Literal["cancelled", "failed"]
    """cancelled (every request of the batch was gone) or failed."""
    message: str
    """The error message shown to the client."""

    @classmethod
    def of(cls, error: DiffuserveError) -> ErrorInfo:
        return cls("cancelled" if isinstance(error, RequestCancelledError) else "failed", error.message)

    def to_error(self) -> DiffuserveError:
        return RequestCancelledError(self.message) if self.kind == "cancelled" else GenerationError(self.message)


@dataclass(frozen=True)
class BatchReport:
    """A replica leader's answer to a `BatchMessage`: per request an output or an error, plus timings."""

    seq: int
    """The BatchMessage it answers."""
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    """Request id -> its images or videos."""
    errors: dict[str, ErrorInfo] = field(default_factory=dict)
    """Request id -> why it has no output."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per pipeline stage (encode, denoise, decode)."""
    inference_seconds: float = 0.0
    """Wall time of the batch on the replica."""
    batch_rows: int = 0
    """Rows of the largest pipeline call."""
    pipeline_calls: int = 0
    """Pipeline calls the batch ran as."""
    stopped_at_step: int | None = None
    """Steps run when it stopped with every request cancelled (None: it did not stop)."""

    @classmethod
    def of(cls, seq: int, outcome) -> BatchReport:  # outcome: executor.batch_runner.BatchOutcome
        return cls(
            seq=seq,
            outputs=dict(outcome.outputs),
            errors={rid: ErrorInfo.of(e) for rid, e in outcome.errors.items()},
            stage_seconds=dict(outcome.stage_seconds),
            inference_seconds=outcome.inference_seconds,
            batch_rows=outcome.batch_rows,
            pipeline_calls=outcome.pipeline_calls,
            stopped_at_step=outcome.stopped_at_step,
        )

    def fields(self) -> dict:
        """The report as BatchOutcome keyword arguments (errors rebuilt as exceptions)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "seq"}
        values["errors"] = {rid: info.to_error() for rid, info in self.errors.items()}
        return values


Ack = tuple[str, float]
"""A follower's answer to a call: ("ok" or why it failed, seconds the call took to reach it)."""


# -- links ------------------------------------------------------------------------------------------------------
class RankLink:
    """What every rank says about itself through the store, and what rank 0 reads of the others."""

    def __init__(self, channel: StoreChannel):
        self.channel = channel

    def publish_rank(self, rank: int, info: dict[str, Any]) -> None:
        """What /server_info shows of a rank (its pid, host, device); kept, not consumed."""
        self.channel.post(_rank_key(rank), info)

    def rank_info(self, rank: int) -> dict[str, Any] | None:
        return self.channel.peek(_rank_key(rank))

    def beat(self, rank: int) -> None:
        """One heartbeat of `rank` (raises when the store is gone)."""
        self.channel.count(_heartbeat_key(rank), 1)

    def heartbeats(self, rank: int) -> int:
        """How many heartbeats `rank` has sent."""
        return self.channel.count(_heartbeat_key(rank), 0)

    def report_fault(self, rank: int, message: str) -> None:
        self.channel.post(_fault_key(rank), message)

    def fault(self, rank: int) -> str | None:
        """The failure `rank` reported about itself, if any (kept: the monitor reads it every round)."""
        return self.channel.peek(_fault_key(rank))

    def say_bye(self, rank: int) -> None:
        """Posted by a rank leaving on a shutdown message, so rank 0 keeps the store up until everyone read it."""
        self.channel.post(_bye_key(rank), "bye")

    def wait_bye(self, rank: int, timeout_s: float) -> None:
        self.channel.receive(_bye_key(rank), timeout_s=timeout_s)


class ReplicaLink:
    """One replica's messages: rank 0 <-> the replica's leader (batches, progress, cancel, reports) and the leader
    <-> the replica's other ranks (pipeline calls or continuous steps, and their acks). Both ends use the same
    link; each method says which end calls it."""

    def __init__(self, channel: StoreChannel, replica: int):
        self.channel, self.replica = channel, replica

    # -- rank 0 -> the replica's leader ---------------------------------------------------------------------------
    def post_batch(self, message: BatchMessage) -> None:
        """Rank 0: the batch (or the shutdown) numbered `message.seq` for the leader."""
        self.channel.post(_batch_key(self.replica, message.seq), message)

    def poll_report(self, seq: int) -> BatchReport | None:
        """Rank 0: the leader's report on batch `seq` once it is there (then the batch's progress and cancel
        keys are removed too), else None."""
        report = self.channel.poll(_report_key(self.replica, seq))
        if report is not None:
            self.channel.delete(
                _progress_key(self.replica, seq), _progress_total_key(self.replica, seq), _cancel_key(self.replica, seq)
            )
        return report

    def read_progress(self, seq: int) -> tuple[int, int]:
        """Rank 0: (steps finished, steps in all) of batch `seq`; (0, 0) before its first step."""
        done = self.channel.count(_progress_key(self.replica, seq), 0)
        if done == 0:
            return 0, 0
        return done, int(self.channel.peek(_progress_total_key(self.replica, seq)) or 0)

    def request_cancel(self, seq: int) -> None:
        """Rank 0: every request of batch `seq` is gone; the leader stops it at the next step boundary."""
        self.channel.post(_cancel_key(self.replica, seq), True)

    # -- the replica's leader <- rank 0 -------------------------------------------------------------------------
    def receive_batch(self, seq: int, keep_waiting: Callable[[], bool]) -> BatchMessage:
        """Leader: wait for rank 0's batch `seq` (ChannelClosed when `keep_waiting()` says no)."""
        return self.channel.receive(_batch_key(self.replica, seq), keep_waiting=keep_waiting)

    def report_progress(self, seq: int, step: int, total: int) -> None:
        """Leader: one more step of batch `seq` finished (step 0 also records how many there are)."""
        if step == 0:
            self.channel.post(_progress_total_key(self.replica, seq), total)
        self.channel.count(_progress_key(self.replica, seq), 1)  # atomic: rank 0 reads it with count(0)

    def cancelled(self, seq: int) -> bool:
        """Leader: rank 0 asked to stop batch `seq`."""
        return self.channel.exists(_cancel_key(self.replica, seq))

    def post_report(self, report: BatchReport) -> None:
        """Leader: the answer to batch `report.seq` (rank 0 removes the batch's other keys)."""
        self.channel.post(_report_key(self.replica, report.seq), report)

    # -- the replica's leader <-> its other ranks ---------------------------------------------------------------
    def post_call(self, rank: int, message: CallMessage | StepMessage) -> None:
        """Leader: a pipeline call, continuous step or shutdown for `rank` (one key per reader)."""
        self.channel.post(_call_key(self.replica, message.seq, rank), message)

    def receive_call(self, seq: int, rank: int, keep_waiting: Callable[[], bool]) -> CallMessage | StepMessage:
        """Follower `rank`: wait for its leader's call `seq`."""
        return self.channel.receive(_call_key(self.replica, seq, rank), keep_waiting=keep_waiting)

    def post_ack(self, seq: int, rank: int, ack: Ack) -> None:
        """Follower `rank`: call `seq` is done here."""
        self.channel.post(_ack_key(self.replica, seq, rank), ack)

    def receive_ack(self, seq: int, rank: int, keep_waiting: Callable[[], bool], timeout_s: float) -> Ack:
        """Leader: wait for `rank`'s ack of call `seq` (ChannelClosed past `timeout_s` or when `keep_waiting()`
        says no)."""
        return self.channel.receive(_ack_key(self.replica, seq, rank), keep_waiting=keep_waiting, timeout_s=timeout_s)
