"""The request scheduler as the engine and its loops see it: one typed `Protocol` both batching modes implement.

`RequestLevelScheduler` (engine/scheduler.py: singleton and dynamic batching) and `StepScheduler`
(engine/step_scheduler.py: continuous batching, whose request-level fallback batches run on the same loop) both
satisfy it; every verb is declared, so no caller probes with `getattr` for an optional one. Both read
`max_adapters` from the one `BatchingConfig` they are built with (`launch/root.py build_batcher`). Every method
is called under the engine lock (`RequestBook.cond`).
"""

from __future__ import annotations

from typing import Protocol

from diffuserve.engine.request import Request
from diffuserve.engine.scheduler import BatchingConfig, Dispatch, Idle, ScheduledBatch, WaitUntil
from diffuserve.engine.step_scheduler import StepPlan


class RequestScheduler(Protocol):
    """Queue, batch formation and the answers' feedback: what `AsyncEngine`, `BatchLoop` and the status read."""

    @property
    def config(self) -> BatchingConfig:
        """The batching flags, `max_adapters` included (one config for both modes)."""
        ...

    activation_budget: int | None
    """Activation bytes a replica may hold at once (scheduler rule 9); None: no memory admission."""

    token_budget: int | None
    """Latent tokens a batch may hold (`--batching-max-tokens` or its default, `config/token_budget.py`); None: rows
    only."""

    def set_capabilities(
        self,
        *,
        supports_batching: bool,
        supports_continuous: bool = False,
        packs_mixed_sizes: bool = False,
        strength_per_row: bool = False,
        continuous_key_fields: tuple[str, ...] = (),
    ) -> None:
        """What the loaded model can do: merge requests at all, run them step by step, pack rows of different sizes
        into one call (then width and height leave the batch signature and the continuous group key), run edits of
        different strengths in one call (then `strength` leaves the batch signature), and the family's own fields of
        the continuous group key (`FamilySpec.continuous_key_fields`)."""

    def add(self, request: Request) -> None:
        """Queue an admitted request."""

    def abort(self, request_id: str) -> Request | None:
        """Drop a queued request; None when it is not queued (running, answered or unknown)."""

    def expire(self, now: float) -> list[Request]:
        """Remove and return the queued requests past their deadline."""

    def drain(self) -> list[Request]:
        """Remove and return every queued request (they must never start)."""

    def next_deadline(self) -> float | None:
        """The earliest queued deadline (when the loop must wake to expire it)."""

    @property
    def num_queued(self) -> int:
        """Requests waiting."""
        ...

    @property
    def num_running(self) -> int:
        """Request-level batches running now."""
        ...

    @property
    def running_batches(self) -> tuple[ScheduledBatch, ...]:
        """Every request-level batch running now."""
        ...

    def is_running(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` still holds a replica (not `complete`d yet)."""

    def schedule(self, now: float) -> Dispatch | WaitUntil | Idle | StepPlan:
        """The next decision; a `StepPlan` only from the continuous scheduler (its own loop handles it)."""

    def complete(self, batch: ScheduledBatch) -> None:
        """A request-level batch finished running: free its replica."""

    def note_answering(self, batch: ScheduledBatch) -> None:
        """`batch`'s outputs are decoding in the decode lane; its answers follow (scheduler rule 8)."""

    def note_answered(self, batch: ScheduledBatch, now: float) -> None:
        """`batch`'s answers went out at `now` (scheduler rule 8)."""

    def requests_using_adapter(self, name: str) -> list[Request]:
        """Queued and running requests whose `lora` names adapter `name` (an unload waits for them)."""
