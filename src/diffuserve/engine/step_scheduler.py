"""The pure step-level scheduler of `--batching-mode continuous`: which rows denoise together at each step.

Like `engine/scheduler.py` (whose `RequestLevelScheduler` it composes for the queue, ordering, caps, expiry and the
request-level rules) it has no torch, no I/O, no threads and no clock of its own. It answers the same verb as the
request-level scheduler; the engine's step loop (`engine/step_loop.py`) is::

    decision = scheduler.schedule(now)
    StepPlan  -> start decision.joined (encode + latents; beside the loop: they are not `ready` yet), run ONE
                 denoising step for the ready rows, then scheduler.step_done(decision, those rows) -> the
                 requests whose last step it was (decode + answer)
    Dispatch  -> a request-level batch (a head that cannot run step by step): run it whole, then complete()
    WaitUntil -> sleep until the time or a new request, then schedule again
    Idle      -> sleep until a request arrives

Rules (on top of the module docstring of `engine/scheduler.py`: order, caps counting rows, delay):

1. **The running group.** Requests denoising together; each keeps its own step index and step count, so
   rows at different timesteps (and with different step counts) share one denoiser call.
2. **Group key** (`group_key`): requests share a group when they have the same model name and the same width,
   height, num_frames (latent shape), guidance_scale, true_cfg_scale, guidance_scale_2, strength and cfg_enabled
   (whether CFG runs). For a family that packs rows of different sizes into one denoiser call
   (`FamilySpec.packs_mixed_sizes`, through `set_capabilities`) width and height leave the key: a request of
   another size joins the running group at a step boundary. A family adds its own fields through
   `FamilySpec.continuous_key_fields` (LTX-2: `fps` sets its audio length, `generate_audio` whether audio tokens
   exist). dtype and scheduler kind are one per served pipeline,
   so they are equal by construction. `num_inference_steps` is NOT in the key: the per-row scheduler handles each
   row's own schedule. Only eligible requests (`ineligible_reason` None, for example no input images) of a family
   that declares `supports_continuous` run step by step.
3. **Joining.** At every step boundary queued requests are scanned in `(priority, arrival)` order and join
   while they match the key, their `n` fits under the cap and their LoRA adapters keep the group within
   `max_adapters` distinct adapters (`--max-loras`, the device slots every step's rows must fit in at once);
   the scan stops at the first one that does not (strict first-come order, so a large or incompatible request is
   never overtaken forever: it joins once rows leave room, at the latest it anchors the next group). Under
   `--batching-order drr` the order is rule 8's instead; the scan stops the same way.
4. **Cap.** `min(--batching-max-size, smallest matching rule cap)` of the group's first request, in rows (a
   joining size of a packed group must also fit its own rule cap), and the **token budget** (`token_budget`, the
   composed queue's): the group's latent tokens (`Request.tokens`) plus a joiner's must fit in it. A request whose
   `n` or tokens alone reach a limit starts only in an empty group (and then runs alone, never refused).
5. **Starting a group.** With the group empty the head waits up to `--batching-delay-ms` for companions (as in
   dynamic mode), unless it is already full. The head is the queue's (`fifo`) or rule 8's choice (`drr`). A head
   that cannot run step by step is handed to the request-level rules instead (`RequestLevelScheduler.schedule` with
   it as the anchor: it runs alone, or merged with equal signatures when the family batches but is not continuous).
6. **Activation memory.** With a budget (the composed scheduler's `activation_budget`), a request joins only while
   the group's `activation_bytes` plus its own fit in it (rule 3's strict order: the scan stops at it); a group
   always starts with its head (a request over the budget alone is refused at admission).
7. **Leaving.** A request leaves after its own last step (`step_done`), or at the next boundary when it was
   cancelled (`cancel_event` set: client gone, engine shutdown) or its deadline passed (`schedule` returns it in
   `removed`). A step that raised removes every request in it (`fail`).
8. **Fair order** (`--batching-order drr`). Among the queued requests of the best priority (priority stays
   strict), the next to join (or to anchor an empty group) is the oldest of the *class* (the group key with the
   size, so sizes take turns also where they share a group; a request that cannot step: the request-level class)
   whose turn it is in a deficit round-robin by tokens x steps (`engine/fair_order.py`); each entry pays its own
   tokens x steps. The scan stops at the chosen request when it cannot join (rules 3, 4, 6), and the turn stays
   its class's until it joins (the round's state changes only on an entry): a 1024x1024 request whose turn it is
   not yet does not hold back the 512x512 ones behind it, and once its turn comes they stop joining until rows
   leave room for it, or it anchors the next group (no starvation). One class waiting: the queue's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from diffuserve.engine.fair_order import DeficitRoundRobin, Turn, tokens_x_steps
from diffuserve.engine.request import Request, RequestStatus
from diffuserve.engine.scheduler import (
    SIZE_FIELDS,
    BatchingConfig,
    Dispatch,
    Idle,
    RequestLevelScheduler,
    ScheduledBatch,
    WaitUntil,
    uses_adapter,
)

GROUP_KEY_FIELDS = (
    "width",
    "height",
    "num_frames",
    "guidance_scale",
    "true_cfg_scale",
    "guidance_scale_2",
    "strength",
    "cfg_enabled",
    "step_cache_method",
)
"""The `SamplingParams` fields (besides the model name) of the continuous group key (rule 2)."""
REMOVED_CANCELLED = "cancelled"
REMOVED_DEADLINE = "deadline"


def group_key(
    request: Request, *, packs_mixed_sizes: bool = False, family_fields: Sequence[str] = ()
) -> tuple[Any, ...]:
    """The continuous denoising-group key of `request` (rule 2 of the module docstring); without width and height
    for a family that packs rows of different sizes into one denoiser call; with the family's own fields."""
    names = [n for n in GROUP_KEY_FIELDS if not (packs_mixed_sizes and n in SIZE_FIELDS)]
    names += [n for n in family_fields if n not in names]
    return (request.model, *(getattr(request.params, name) for name in names))


@dataclass(eq=False)
class GroupEntry:
    """One request of the running group and where it is in its own schedule."""

    request: Request
    num_steps: int
    """Denoising steps of this request (its `num_inference_steps`; the pipeline may report fewer, e.g. edits)."""
    step_index: int = 0
    """Steps done so far; the next step this request runs is `step_index`."""
    state: Any = None
    """The engine's per-request denoising state (latents, scheduler); opaque to the scheduler."""
    ready: bool = True
    """False while the engine is still starting the request (its text encode runs beside the loop): it holds
    its place (and its rows of the cap) in the group, but steps only from the first boundary after it is ready."""

    @property
    def num_rows(self) -> int:
        return self.request.num_outputs


@dataclass
class StepPlan:
    """Run one denoising step for `rows` (the joined ones must be started first)."""

    rows: list[GroupEntry]
    """Every request in this step, longest-running first, then the joined ones in join order."""
    joined: list[GroupEntry]
    """Requests that joined at this boundary (a subset of `rows`)."""
    removed: list[tuple[Request, str]] = field(default_factory=list)
    """Requests dropped at this boundary before the step: `cancelled` or `deadline` (the engine answers them)."""
    left: int = 0
    """Requests that left the group since the previous step (finished, removed or failed)."""
    cap: int = 1
    """The group's effective cap in rows."""
    user_max: int = 1
    """`--batching-max-size`."""
    step_id: int = 0
    """Increasing number of the step (1 for the first step of a scheduler)."""

    @property
    def num_rows(self) -> int:
        return sum(e.num_rows for e in self.rows)

    @property
    def num_tokens(self) -> int:
        """Latent tokens of the step's rows (`Request.tokens`)."""
        return sum(e.request.tokens for e in self.rows)


StepDecision = Dispatch | StepPlan | WaitUntil | Idle
"""What `StepScheduler.schedule` returns: a request-level batch, one denoising step, a wait, or nothing."""


class StepScheduler:
    """The request queue (a composed `RequestLevelScheduler`) plus the running group of the module docstring.
    Not thread-safe."""

    def __init__(
        self,
        config: BatchingConfig,
        *,
        model_names: Sequence[str],
        supports_batching: bool = True,
        supports_continuous: bool = True,
    ):
        self.requests = RequestLevelScheduler(config, model_names=model_names, supports_batching=supports_batching)
        """The queue and the request-level rules (heads that cannot run step by step are dispatched by it)."""
        self.supports_continuous = supports_continuous
        """Whether the served family can run step by step (set by the engine once the pipeline is loaded)."""
        self.continuous_key_fields: tuple[str, ...] = ()
        """The served family's own `SamplingParams` fields of the group key (rule 2; set with the capabilities)."""
        self._group: list[GroupEntry] = []
        self._fair = DeficitRoundRobin()
        """Rule 8's round over the waiting classes (`--batching-order drr`)."""
        self._cap = 1
        self._left = 0
        self._steps = 0

    # -- the queue (the composed request scheduler's) ----------------------------------------------------
    @property
    def config(self) -> BatchingConfig:
        return self.requests.config

    @property
    def supports_batching(self) -> bool:
        return self.requests.supports_batching

    @property
    def activation_budget(self) -> int | None:
        """Activation bytes the group (or a request-level batch) may hold (rule 6); the composed queue's."""
        return self.requests.activation_budget

    @activation_budget.setter
    def activation_budget(self, budget: int | None) -> None:
        self.requests.activation_budget = budget

    def set_capabilities(
        self,
        *,
        supports_batching: bool,
        supports_continuous: bool = False,
        packs_mixed_sizes: bool = False,
        strength_per_row: bool = False,
        continuous_key_fields: tuple[str, ...] = (),
    ) -> None:
        """What the loaded model can do: merge requests at all, run them step by step, pack mixed sizes, mix
        strengths in a request-level batch (the continuous group key keeps `strength`), and the family's own fields
        of the group key (rule 2)."""
        self.requests.set_capabilities(
            supports_batching=supports_batching, packs_mixed_sizes=packs_mixed_sizes, strength_per_row=strength_per_row
        )
        self.supports_continuous = supports_continuous
        self.continuous_key_fields = tuple(continuous_key_fields)

    @property
    def packs_mixed_sizes(self) -> bool:
        """Rows of different sizes may share the group (rule 2); the composed queue's fact."""
        return self.requests.packs_mixed_sizes

    @property
    def token_budget(self) -> int | None:
        """Latent tokens the group may hold (rule 4); the composed queue's."""
        return self.requests.token_budget

    @token_budget.setter
    def token_budget(self, budget: int | None) -> None:
        self.requests.token_budget = budget

    def add(self, request: Request) -> None:
        if any(e.request.request_id == request.request_id for e in self._group):
            raise ValueError(f"request id {request.request_id!r} is already running; ids must be unique")
        self.requests.add(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a queued request; running rows leave at the next boundary by their `cancel_event`."""
        return self.requests.abort(request_id)

    def expire(self, now: float) -> list[Request]:
        return self.requests.expire(now)

    def drain(self) -> list[Request]:
        """Queued requests (see `RequestLevelScheduler.drain`); running rows stop at the next boundary by their
        `cancel_event`, which the engine sets."""
        return self.requests.drain()

    def next_deadline(self) -> float | None:
        return self.requests.next_deadline()

    def is_queued(self, request_id: str) -> bool:
        return self.requests.is_queued(request_id)

    @property
    def num_queued(self) -> int:
        return self.requests.num_queued

    @property
    def num_queued_outputs(self) -> int:
        return self.requests.num_queued_outputs

    @property
    def running(self) -> ScheduledBatch | None:
        """The request-level batch in flight (a head that could not step), or None."""
        return self.requests.running

    @property
    def num_running(self) -> int:
        return self.requests.num_running

    @property
    def running_batches(self) -> tuple[ScheduledBatch, ...]:
        return self.requests.running_batches

    def is_running(self, batch: ScheduledBatch) -> bool:
        return self.requests.is_running(batch)

    def complete(self, batch: ScheduledBatch) -> None:
        self.requests.complete(batch)

    def note_answering(self, batch: ScheduledBatch) -> None:
        """Nothing: the group's joins never wait on a fallback batch's answers (rule 8 is dynamic mode's)."""

    def note_answered(self, batch: ScheduledBatch, now: float) -> None:
        """Nothing, as `note_answering`."""

    def effective_cap_for(self, request: Request) -> int:
        return self.requests.effective_cap_for(request)

    # -- state ------------------------------------------------------------------------------------------
    @property
    def group(self) -> list[GroupEntry]:
        """The running group (a copy)."""
        return list(self._group)

    @property
    def num_active_rows(self) -> int:
        return sum(e.num_rows for e in self._group)

    @property
    def num_active_tokens(self) -> int:
        """Latent tokens of the group's rows (rule 4's token budget counts them)."""
        return sum(e.request.tokens for e in self._group)

    def requests_using_adapter(self, name: str) -> list[Request]:
        """The queued and running requests whose `lora` names adapter `name`: the queue, a request-level batch in
        flight, and the group's rows (those still starting too). An unload waits for them."""
        rows = [e.request for e in self._group if uses_adapter(e.request, name)]
        return self.requests.requests_using_adapter(name) + rows

    def can_step(self, request: Request) -> bool:
        """Whether `request` may run step by step (rule 2's eligibility)."""
        return self.supports_continuous and self.requests.ineligible_reason(request) is None

    # -- scheduling ---------------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepDecision:
        """What to do at clock time `now` (see the module docstring). A returned plan must be followed by
        `step_done` or `fail`; a returned `Dispatch` by `complete`."""
        if self.running is not None:
            return Idle(busy=True)
        removed = self._remove_stopped(now)
        if removed and not self._group:  # no step to run, but the engine must answer the removed ones now
            return StepPlan(
                rows=[], joined=[], removed=removed, left=self._pop_left(), cap=self._cap, user_max=self.config.max_size
            )
        if self._group:
            joined = self._take_joiners(self._key(self._group[0].request), self._cap - self.num_active_rows)
            return self._step(joined, removed)
        ordered = self.requests.queued_requests()
        if not ordered:
            return Idle()
        head, turn = self._next_in_order(ordered)
        if not self.can_step(head):
            decision = self.requests.schedule(now, anchor=head)
            if isinstance(decision, Dispatch) and turn is not None:
                self._fair.commit(turn, sum(tokens_x_steps(r) for r in decision.batch.requests))
            return decision
        cap = self.effective_cap_for(head)
        rows = self._fitting_rows(head, cap)
        if rows < cap and now < head.arrival_time + self.config.delay_ms / 1000.0:
            return WaitUntil(head.arrival_time + self.config.delay_ms / 1000.0)
        self._cap = cap
        joined = [self._enter(head, turn)]
        joined += self._take_joiners(self._key(head), cap - head.num_outputs)
        return self._step(joined, removed)

    def step_done(self, plan: StepPlan, stepped: Sequence[GroupEntry] | None = None) -> list[GroupEntry]:
        """The step of `plan` ran for `stepped` (default: every row of the plan; the engine leaves out the rows
        that were not ready yet): each advanced one step. Returns (and removes) the finished requests."""
        finished = []
        for entry in plan.rows if stepped is None else stepped:
            entry.step_index += 1
            if entry.step_index >= entry.num_steps and entry in self._group:
                finished.append(entry)
        return self._leave(finished, RequestStatus.FINISHED)

    def fail(self, entries: Sequence[GroupEntry]) -> list[GroupEntry]:
        """The step (or start) of `entries` raised: they leave the group (status FAILED)."""
        return self._leave([e for e in entries if e in self._group], RequestStatus.FAILED)

    # -- helpers ------------------------------------------------------------------------------------------
    def _step(self, joined: list[GroupEntry], removed: list[tuple[Request, str]]) -> StepPlan:
        self._steps += 1
        return StepPlan(
            rows=list(self._group),
            joined=joined,
            removed=removed,
            left=self._pop_left(),
            cap=self._cap,
            user_max=self.config.max_size,
            step_id=self._steps,
        )

    def _pop_left(self) -> int:
        left, self._left = self._left, 0
        return left

    def _leave(self, entries: list[GroupEntry], status: RequestStatus) -> list[GroupEntry]:
        for entry in entries:
            self._group.remove(entry)
            entry.request.status = status
        self._left += len(entries)
        return entries

    def _remove_stopped(self, now: float) -> list[tuple[Request, str]]:
        removed: list[tuple[Request, str]] = []
        for entry in list(self._group):
            request = entry.request
            if request.cancel_event.is_set():
                self._leave([entry], RequestStatus.ABORTED)
                removed.append((request, REMOVED_CANCELLED))
            elif request.deadline is not None and request.deadline <= now:
                self._leave([entry], RequestStatus.TIMED_OUT)
                removed.append((request, REMOVED_DEADLINE))
        return removed

    def _key(self, request: Request) -> tuple[Any, ...]:
        return group_key(request, packs_mixed_sizes=self.packs_mixed_sizes, family_fields=self.continuous_key_fields)

    def _compatible(self, key: tuple[Any, ...], request: Request) -> bool:
        return self.can_step(request) and self._key(request) == key

    def _fitting_rows(self, head: Request, cap: int) -> int:
        """Rows a group anchored by `head` would start with (the scan of `_take_joiners` in queue order after the
        head; under `drr` an estimate, as the joins follow rule 8)."""
        rows, tokens, key, adapters = 0, 0, self._key(head), frozenset[str]()
        budget = self.token_budget
        for request in [head, *(r for r in self.requests.queued_requests() if r is not head)]:
            more = self._adapters_with(adapters, request)
            if not self._compatible(key, request) or (rows and rows + request.num_outputs > cap) or more is None:
                break
            if rows and budget is not None and tokens + request.tokens > budget:
                break
            rows, tokens, adapters = rows + request.num_outputs, tokens + request.tokens, more
        return rows

    def _take_joiners(self, key: tuple[Any, ...], room: int) -> list[GroupEntry]:
        joined = []
        adapters = frozenset(name for e in self._group for name, _ in e.request.params.lora)
        budget = self.activation_budget
        memory = None if budget is None else budget - sum(e.request.activation_bytes for e in self._group)
        tokens = None if self.token_budget is None else self.token_budget - self.num_active_tokens
        while ordered := self.requests.queued_requests():
            request, turn = self._next_in_order(ordered)  # rule 3 (fifo: the queue's head) or rule 8 (drr)
            more = self._adapters_with(adapters, request)
            if room <= 0 or not self._compatible(key, request) or request.num_outputs > room or more is None:
                break  # rule 3: the scan stops at the first request that cannot join
            if tokens is not None and request.tokens > tokens:
                break  # rule 4: it joins once rows leave room in the token budget (a head starts anyway, alone)
            if memory is not None and request.activation_bytes > memory:
                break  # rule 6: it waits until rows leave
            if self.packs_mixed_sizes and self.num_active_rows + request.num_outputs > self.effective_cap_for(request):
                break  # rule 4: a size whose own rule cap the group would exceed waits
            joined.append(self._enter(request, turn))
            room, adapters = room - request.num_outputs, more
            tokens = None if tokens is None else tokens - request.tokens
            memory = None if memory is None else memory - request.activation_bytes
        return joined

    def _next_in_order(self, ordered: list[Request]) -> tuple[Request, Turn | None]:
        """The next request to join or anchor (rule 3 / rule 8) and, under `drr`, the planned turn its entry
        commits. `ordered` is the queue in `(priority, arrival)` order (not empty)."""
        if self.config.order != "drr":
            return ordered[0], None
        heads: dict[Any, Request] = {}
        for request in ordered:
            if request.priority != ordered[0].priority:
                break  # priority stays strict
            heads.setdefault(self._fair_class(request), request)
        if len(heads) == 1:
            return ordered[0], None
        turn = self._fair.plan({key: tokens_x_steps(r) for key, r in heads.items()})
        return heads[turn.key], turn

    def _fair_class(self, request: Request) -> tuple[Any, ...]:
        """Rule 8's class: the group key with the size (each size takes its turn also where sizes share a group);
        for a request that cannot step, the request-level scheduler's class (its rule 10)."""
        if not self.can_step(request):
            return ("request-level", self.requests.class_key(request))
        return group_key(request, family_fields=self.continuous_key_fields)

    def _adapters_with(self, adapters: frozenset[str], request: Request) -> frozenset[str] | None:
        """The group's distinct LoRA adapters once `request` joins; None when they would exceed `max_adapters`."""
        more = adapters | {name for name, _ in request.params.lora}
        limit = self.config.max_adapters
        return None if limit is not None and len(more) > limit else more

    def _enter(self, request: Request, turn: Turn | None = None) -> GroupEntry:
        if turn is not None:
            self._fair.commit(turn, tokens_x_steps(request))
        self.requests.take(request.request_id)
        request.status = RequestStatus.RUNNING
        entry = GroupEntry(request=request, num_steps=request.params.num_inference_steps)
        self._group.append(entry)
        return entry
