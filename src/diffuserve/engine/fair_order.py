"""Deficit round-robin over the waiting batch classes (`--batching-order drr`; engine/scheduler.py rule 10).

A *class* is what must match to share a batch (model, eligibility, the signature; without the size where the family
packs mixed sizes). Each class's next batch costs its head's tokens x steps. Classes take turns in the order they
first waited; a class whose credit (deficit) covers its head's cost runs and pays the batch's whole cost (it may go
into debt: a batch is larger than its head); one that cannot afford it earns a quantum (the cheapest head's cost) and
the turn passes. So every class gets about the same tokens x steps per round: a 1024x1024 class runs one batch while
a 512x512 class runs about four, and neither waits for the other's whole queue (no starvation: credit only grows
while a class waits). A class that empties leaves the round and forgets its credit (standard DRR).

Pure (no clock, no I/O). `plan` never changes the state (the scheduler may plan and then wait for the delay);
`commit` applies a planned turn once its batch is dispatched.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from diffuserve.engine.request import Request

MAX_COST_RATIO = 64.0
"""The quantum is at least the dearest head's cost / this, so a plan takes a bounded number of turns."""


def tokens_x_steps(request: Request) -> float:
    """What a request costs in the round: its latent tokens (all rows) x its denoising steps."""
    return float(request.tokens * max(1, request.params.num_inference_steps))


@dataclass(frozen=True)
class Turn:
    """A planned turn: the class that runs next and the round's state once it was chosen."""

    key: Hashable
    """The class that runs."""
    deficits: dict[Hashable, float]
    """Every waiting class's credit after the visits that led to `key` (before paying for its batch)."""
    order: tuple[Hashable, ...]
    """The round order of the waiting classes."""


class DeficitRoundRobin:
    """The round's state between dispatches: the classes' credit, their order and whose turn it is."""

    def __init__(self) -> None:
        self._deficits: dict[Hashable, float] = {}
        self._order: tuple[Hashable, ...] = ()
        self._current: Hashable | None = None

    def plan(self, heads: Mapping[Hashable, float]) -> Turn:
        """The class that runs next among `heads` (class -> its head's cost, in the order of their oldest
        requests; at least one). Does not change the state."""
        order = tuple(k for k in self._order if k in heads) + tuple(k for k in heads if k not in self._order)
        deficits = {k: self._deficits.get(k, 0.0) for k in order}
        dearest = max(heads.values())
        quantum = max(min(heads.values()), dearest / MAX_COST_RATIO, 1e-9)
        index = order.index(self._current) if self._current in order else 0
        while True:  # ends: every visit that does not run a class adds a quantum to its credit
            key = order[index]
            if deficits[key] >= heads[key]:
                return Turn(key=key, deficits=deficits, order=order)
            deficits[key] += quantum
            index = (index + 1) % len(order)

    def commit(self, turn: Turn, cost: float) -> None:
        """`turn`'s class dispatched a batch costing `cost`; its turn goes on while its credit lasts."""
        self._deficits = dict(turn.deficits)
        self._deficits[turn.key] -= cost
        self._order = turn.order
        self._current = turn.key

    def credit(self, key: Hashable) -> float:
        """A class's credit now (0 for a class that is not waiting): for tests and logs."""
        return self._deficits.get(key, 0.0)
