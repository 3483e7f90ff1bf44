"""The pure scheduler: the queue, dynamic batch formation, caps and stop reasons.

No torch, no I/O, no threads and no clock: every time is passed in by the engine, so the unit
tests drive it with fake requests and a fake clock. The engine's loop is::

    decision = batcher.schedule(now)
    Dispatch  -> run decision.batch on the worker, then batcher.complete(decision.batch)
    WaitUntil -> sleep until decision.time or until a request is added/aborted, then schedule again
    Idle      -> sleep until a request is added (or, when busy, until the running batch completes)

Rules of batch formation (one batch in flight per replica: `slots` batches at most, 1 unless the
server runs data-parallel replicas; a batch is formed only when a replica is free to run it, so it always
goes to a free replica):

1. **Order.** Queued requests are ordered by `(priority, arrival_time)`, lower first, ties by
   the order they were added. The *head* is the first of that order. A lower `priority` value
   therefore runs earlier; equal priorities are first come, first served. Priority is strict: a
   steady stream of low values can starve higher ones, so use a few classes, not a fine scale.
2. **Anchor.** The head (under `--batching-order drr`: rule 10's choice) always belongs to the next batch.
   Requests that cannot join the head stay queued in place and are served when they become head.
3. **Joining.** Other queued requests are scanned in the same `(priority, arrival_time)` order;
   one joins when it is compatible with the head and its `n` outputs still fit under the
   effective cap. Compatible means: same model, both eligible (`Request.ineligible_reason` is
   None and the family supports batching) and equal `SamplingParams.signature()`, less the size
   (`SIZE_FIELDS`) for a family that packs rows of different sizes into one call
   (`FamilySpec.packs_mixed_sizes`, read from the loaded model's `Capabilities.packs_mixed_sizes` through
   `set_capabilities`; False keeps the size in the signature), and less `strength` for a family whose edits of
   different strengths share a call (`FamilySpec.strength_per_row`; not with a step cache, whose rows count the
   batch's steps). Each candidate left out is counted once
   under the first reason that excluded it: its ineligible reason (for example `image_conditioning`),
   `model`, `sampling_params.<field>`, `batch_full` (compatible but its `n` does not fit in the room
   left; smaller requests behind it may still join) or `token_budget` (its tokens do not fit in what is left).
4. **Cap.** The effective cap is `min(--batching-max-size, smallest matching rule cap)` for the
   head's model names, resolution and frame count (of every size in a packed batch), counted in outputs
   (rows), not requests. Beside it the **token budget** (`token_budget`: `--batching-max-tokens`, or its
   default, `config/token_budget.py`) bounds the batch's latent tokens (`Request.tokens`: rows x tokens
   per row); the batch is full when the budget left holds no further row of its smallest size.
5. **Waiting.** While the batch is below the cap and the head has waited less than
   `--batching-delay-ms` since its arrival, `schedule` returns `WaitUntil(head arrival + delay)`.
6. **Oversized requests.** A head whose `n` alone is at least the effective cap, or whose tokens
   alone fill the token budget, is dispatched at once, alone, as a full batch (`num_outputs` may then
   exceed `effective_cap`), so it never starves and is never refused for the budget. The cap still bounds
   every pipeline call: the batch runner runs such a request as consecutive calls of at most
   `effective_cap` rows (see `executor/batch_runner.py`); over the budget, the cap is the rows that fit in it.
7. **Stop reasons.** `max_size` (reached the user cap), `config_cap:N` (reached a rule cap N below
   the user cap), `max_tokens` (reached the token budget), `delay` (the delay ran out, or was 0, below the cap),
   `dynamic_disabled`
   (singleton mode or max size 1: every batch is one request), `head:<reason>` (the head is
   ineligible and runs alone).
8. **Answers bring requests.** With a delay, a batch below the cap is not formed while a finished batch that
   the head could have joined (same model, eligible, equal signature) is still decoding (`note_answering`).
   Once such a batch's answers went out (`note_answered`), and until as many rows as it had have arrived since,
   the head also waits up to the delay from the latest of those new arrivals, or from when the first of them
   should be back: the answers plus the time the first client took to come back after the previous answers
   (the response, the client and its next request; counted up to `MAX_RETURN_GAP_DELAYS` delays). Closed-loop
   clients answered just now come back a few milliseconds apart, and they join this batch instead of starting
   the next one (8 closed-loop clients, max 8, 5 ms: see docs/operations.md). A head unlike the answered batch
   keeps rule 5 alone; so does every head when the delay is 0.
9. **Activation memory.** With a budget (`activation_budget`, bytes; `diffuserve/activation.py`), a batch starts only
   when the sum of its requests' `activation_bytes` fits beside the batches running or still decoding (counted
   against `slots` budgets, one per replica): a head that does not fit waits (`Idle(busy=True)`; the engine
   schedules again when a batch completes or is answered), and a candidate that does not fit in the room left is
   rejected as `activation_memory` (it waits for a later batch). A head always starts when nothing runs (the
   engine refuses requests whose estimate alone is over the budget, so this only matters if the budget shrank).
10. **Fair order** (`--batching-order drr`). Among the queued requests of the best priority, the anchor of rule 2
   is the oldest request of the class (what must match, rule 3) whose turn it is in a deficit round-robin by
   tokens x steps (`engine/fair_order.py`), so a large size neither starves nor blocks the small ones behind it.
   `fifo` (the default) anchors on the head of the queue.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from diffuserve.config.batching import BatchingConfig  # owned by config/; re-exported
from diffuserve.engine.decisions import Decision, Dispatch, Idle, ScheduledBatch, WaitUntil, batch_facts  # re-exported
from diffuserve.engine.fair_order import DeficitRoundRobin, Turn, tokens_x_steps
from diffuserve.engine.request import Request, RequestStatus
from diffuserve.sampling import SIZE_FIELDS, SamplingParams, row_fields, signature_difference  # noqa: F401 - re-exported

__all__ = ["BatchingConfig", "Decision", "Dispatch", "RequestLevelScheduler", "Idle", "ScheduledBatch", "WaitUntil"]

FAMILY_UNSUPPORTED = "family_unsupported"
"""Ineligible reason given to every request when the pipeline family cannot batch."""
BATCH_FULL = "batch_full"
"""Reject reason: a compatible candidate whose `n` does not fit in the room left."""
MODEL_MISMATCH = "model"
"""Reject reason: a candidate served under another model name than the head."""
LORA_SLOTS = "lora_slots"
"""Reject reason: the candidate's LoRA adapters would give the batch more distinct adapters than `--max-loras` device
slots; it waits for a later batch."""
ACTIVATION_MEMORY = "activation_memory"
"""Reject reason: the candidate's activation estimate does not fit in the budget left beside the batch and what runs
(rule 9); it waits for a later batch."""
TOKEN_BUDGET = "token_budget"
"""Reject reason: the candidate's tokens do not fit in the token budget left (rule 4); smaller ones may still join."""
MAX_RETURN_GAP_DELAYS = 4
"""Rule 8 counts the answered clients' return time (answer -> next admission) up to this many delays."""


def uses_adapter(request: Request, name: str) -> bool:
    """Whether `request`'s rows apply LoRA adapter `name`."""
    return any(adapter == name for adapter, _ in request.params.lora)


class RequestLevelScheduler:
    """Request-level scheduling (singleton and dynamic modes): the queue and the batch-formation rules of the module
    docstring; `StepScheduler` composes it for its queue. Not thread-safe: the
    engine calls it from one thread (or under one lock)."""

    def __init__(
        self, config: BatchingConfig, *, model_names: Sequence[str], supports_batching: bool = True, slots: int = 1
    ):
        config.validate()
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        """Batches that may run at once (one per data-parallel replica)."""
        self.config = config
        self.model_names = tuple(model_names)
        self.supports_batching = supports_batching
        self._queue: dict[str, tuple[tuple[int, float, int], Request]] = {}
        self._seq = 0
        self._num_queued_outputs = 0
        self._running: list[ScheduledBatch] = []
        self._num_dispatched = 0
        self.activation_budget: int | None = None
        """Activation bytes one replica may hold at once (rule 9; set by the engine once the model is loaded);
        None: unbounded."""
        self._answering: list[ScheduledBatch] = []
        """Finished batches whose answers have not gone out yet (decoding in the decode lane), rule 8."""
        self._answered: tuple[Request, float, int] | None = None
        """The head of the batch whose answers went out last, when, and its rows (rule 8)."""
        self._return_gap = 0.0
        """How long after its answers the first of a batch's clients came back last time (rule 8: from the
        engine's answer to the next request's admission there is the response, the client and the request)."""
        self._gap_open = False
        """Whether the first arrival after the last answers is still to come (it measures `_return_gap`)."""
        self.packs_mixed_sizes = False
        self.strength_per_row = False
        """Edits of different strengths share a call (`FamilySpec.strength_per_row`): `strength` leaves rule 3."""
        """The served family packs rows of different sizes into one call (`FamilySpec.packs_mixed_sizes`, set by the
        engine from the loaded model's `Capabilities`): the size leaves the batch signature (rule 3)."""
        self.token_budget: int | None = config.max_tokens
        """Latent tokens one batch may hold (rule 4): `--batching-max-tokens`, or the default the engine resolves
        once the model is loaded (`config/token_budget.py`); None: rows only."""
        self._fair = DeficitRoundRobin()
        """Rule 10's round over the waiting classes (`--batching-order drr`)."""
        self._turn: Turn | None = None
        """The turn planned by the last `schedule` call (committed when its batch is dispatched)."""

    # -- queue ------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request. A request id may be queued or running only once."""
        rid = request.request_id
        if rid in self._queue or any(rid in b.request_ids for b in self._running):
            raise ValueError(f"request id {rid!r} is already queued or running; ids must be unique")
        self._seq += 1
        if self._gap_open and self._answered is not None and request.arrival_time >= self._answered[1]:
            self._gap_open = False
            self._return_gap = min(request.arrival_time - self._answered[1], MAX_RETURN_GAP_DELAYS * self._delay_s)
        request.status = RequestStatus.QUEUED
        self._queue[rid] = ((request.priority, request.arrival_time, self._seq), request)
        self._num_queued_outputs += request.num_outputs

    def abort(self, request_id: str) -> Request | None:
        """Remove a queued request (client gone); None when it is not queued (unknown or running)."""
        request = self._pop(request_id)
        if request is not None:
            request.status = RequestStatus.ABORTED
        return request

    def expire(self, now: float) -> list[Request]:
        """Remove and return queued requests whose deadline has passed (status TIMED_OUT)."""
        expired = [r for _, r in self._queue.values() if r.deadline is not None and r.deadline <= now]
        for request in expired:
            self._pop(request.request_id)
            request.status = RequestStatus.TIMED_OUT
        return expired

    def drain(self) -> list[Request]:
        """Remove and return every queued request in scheduling order; statuses are left to the caller."""
        drained = self._ordered()
        self._queue.clear()
        self._num_queued_outputs = 0
        return drained

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued requests (when the engine should call `expire`)."""
        deadlines = [r.deadline for _, r in self._queue.values() if r.deadline is not None]
        return min(deadlines) if deadlines else None

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queue

    @property
    def max_adapters(self) -> int | None:
        """Most distinct LoRA adapters one batch may use (`BatchingConfig.max_adapters`, from `--max-loras`)."""
        return self.config.max_adapters

    def requests_using_adapter(self, name: str) -> list[Request]:
        """The queued and running requests whose `lora` names adapter `name` (an unload waits for them)."""
        held = [r for _, r in self._queue.values()] + [r for batch in self._running for r in batch.requests]
        return [r for r in held if uses_adapter(r, name)]

    @property
    def _delay_s(self) -> float:
        return self.config.delay_ms / 1000.0

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_queued_outputs(self) -> int:
        """Outputs (rows) waiting in the queue: the sum of the queued requests' `n`."""
        return self._num_queued_outputs

    @property
    def running(self) -> ScheduledBatch | None:
        """The batch in flight, or None."""
        return self._running[0] if self._running else None

    @property
    def num_running(self) -> int:
        """Batches running now (at most `slots`)."""
        return len(self._running)

    @property
    def running_batches(self) -> tuple[ScheduledBatch, ...]:
        """Every batch running now."""
        return tuple(self._running)

    def is_running(self, batch: ScheduledBatch) -> bool:
        return any(b is batch for b in self._running)

    @property
    def activation_in_use(self) -> int:
        """Activation bytes of the batches running or still decoding (rule 9)."""
        batches = {id(b): b for b in (*self._running, *self._answering)}
        return sum(r.activation_bytes for b in batches.values() for r in b.requests)

    def activation_room(self) -> int | None:
        """Activation bytes a new batch may take now (rule 9); None: unbounded."""
        if self.activation_budget is None:
            return None
        return self.activation_budget * self.slots - self.activation_in_use

    def queued_requests(self) -> list[Request]:
        """The queued requests in scheduling order (a copy)."""
        return self._ordered()

    def take(self, request_id: str) -> Request | None:
        """Remove a queued request that another scheduler layer starts (the step scheduler's group); its status
        is left to the caller. None when it is not queued."""
        return self._pop(request_id)

    def ineligible_reason(self, request: Request) -> str | None:
        """Why `request` may not merge with others (its own reason, or the family's), None when it may."""
        return self._ineligible_reason(request)

    def set_capabilities(
        self,
        *,
        supports_batching: bool,
        supports_continuous: bool = False,
        packs_mixed_sizes: bool = False,
        strength_per_row: bool = False,
        continuous_key_fields: tuple[str, ...] = (),
    ) -> None:
        """What the loaded model can do decides what may be merged (the engine calls this once it is loaded);
        the request-level rules have no use for `supports_continuous` nor `continuous_key_fields`."""
        self.supports_batching = supports_batching
        self.packs_mixed_sizes, self.strength_per_row = packs_mixed_sizes, strength_per_row

    # -- scheduling -------------------------------------------------------------------------------
    def schedule(self, now: float, *, anchor: Request | None = None) -> Decision:
        """Decide what to do at clock time `now`; a returned `Dispatch` marks its batch running. `anchor` (a queued
        request) replaces rule 2's choice: the continuous scheduler's fallback for a head that cannot step."""
        if len(self._running) >= self.slots:
            return Idle(busy=True)
        ordered = self._ordered()
        if not ordered:
            return Idle()
        head = self._pick_head(ordered, anchor)
        candidates = [r for r in ordered if r is not head]
        room = self.activation_room()
        if room is not None and head.activation_bytes > room and (self._running or self._answering):
            return Idle(busy=True)  # rule 9: it waits until its estimate fits beside what runs

        # 1. Singleton serving, or a head that may not merge: it runs alone, at once.
        if not self.config.dynamic:
            return self._dispatch([head], 1, "dynamic_disabled", {}, now)
        head_reason = self._ineligible_reason(head)
        if head_reason is not None:
            return self._dispatch([head], self._effective_cap(head), f"head:{head_reason}", {}, now)

        # 2. Take compatible candidates in order while they fit under the cap and the token budget.
        batch, rejects, cap = self._collect(head, candidates, self._effective_cap(head), room)
        num_outputs = sum(r.num_outputs for r in batch)

        # 3. Full: dispatch. Below the cap: wait out the head's delay, then dispatch what there is.
        if num_outputs >= cap:
            reason = "max_size" if cap >= self.config.max_size else f"config_cap:{cap}"
            return self._dispatch(batch, cap, reason, rejects, now)
        if self._tokens_full(batch):
            return self._dispatch(batch, cap, "max_tokens", rejects, now)
        delay = self.config.delay_ms / 1000.0
        if delay > 0 and any(self._alike(head, b.requests[0]) for b in self._answering):
            return Idle(busy=True)  # rule 8: the answers about to go out bring their clients' next requests
        ready_at = head.arrival_time + delay
        if self._answered is not None and self._alike(head, self._answered[0]):
            # Until the answered batch's clients are back (as many rows arrived since), the head waits the delay
            # from the latest of their new requests, or from when the first of them should be back (the answers,
            # plus the time clients took to come back after the previous answers): they come back a few
            # milliseconds apart, however long the way back through the HTTP server and the client is.
            _, answered_at, answered_rows = self._answered
            returned = [r for r in batch if r.arrival_time >= answered_at]
            if sum(r.num_outputs for r in returned) < answered_rows:
                latest = max([answered_at + self._return_gap, *(r.arrival_time for r in returned)])
                ready_at = max(ready_at, latest + delay)
        if now < ready_at:
            return WaitUntil(ready_at)
        return self._dispatch(batch, cap, "delay", rejects, now)

    def note_answering(self, batch: ScheduledBatch) -> None:
        """`batch` finished denoising and decodes in the decode lane: its answers are not out yet (rule 8)."""
        self._answering.append(batch)

    def note_answered(self, batch: ScheduledBatch, now: float) -> None:
        """`batch`'s answers went out at `now` (rule 8)."""
        self._answering = [b for b in self._answering if b is not batch]
        self._answered = (batch.requests[0], now, batch.num_outputs)
        self._gap_open = True

    def complete(self, batch: ScheduledBatch) -> None:
        """The worker finished `batch` (success or failure); the next batch may be dispatched."""
        if not self.is_running(batch):
            running = [b.batch_id for b in self._running] or None
            raise ValueError(f"complete() got batch {batch.batch_id}, but the running batch is {running}")
        self._running = [b for b in self._running if b is not batch]

    def effective_cap_for(self, request: Request) -> int:
        """The cap a batch anchored by `request` would get (1 when merging is off)."""
        return self._effective_cap(request) if self.config.dynamic else 1

    # -- helpers ----------------------------------------------------------------------------------
    def _ordered(self) -> list[Request]:
        return [r for _, r in sorted(self._queue.values(), key=lambda item: item[0])]

    def _pop(self, request_id: str) -> Request | None:
        item = self._queue.pop(request_id, None)
        if item is None:
            return None
        self._num_queued_outputs -= item[1].num_outputs
        return item[1]

    def _ineligible_reason(self, request: Request) -> str | None:
        if request.ineligible_reason is not None:
            return request.ineligible_reason
        return None if self.supports_batching else FAMILY_UNSUPPORTED

    def _names_of(self, request: Request) -> tuple[str, ...]:
        if request.model and request.model not in self.model_names:
            return (*self.model_names, request.model)
        return self.model_names

    def _effective_cap(self, head: Request) -> int:
        cap = self.config.max_size
        rules = self.config.rules
        if rules is not None:
            p = head.params
            rule_cap = rules.cap_for(self._names_of(head), p.width, p.height, p.num_frames)
            if rule_cap is not None:
                cap = min(cap, rule_cap)
        return cap

    def _collect(
        self, head: Request, candidates: Iterable[Request], cap: int, memory: int | None = None
    ) -> tuple[list[Request], dict[str, int], int]:
        """The batch anchored by `head`, the rejects by reason and the batch's cap (the smallest rule cap of its
        sizes where sizes mix)."""
        batch = [head]
        rows = head.num_outputs
        tokens = None if self.token_budget is None else self.token_budget - head.tokens
        memory = None if memory is None else memory - head.activation_bytes
        rejects: dict[str, int] = {}
        adapters = {name for name, _ in head.params.lora}
        for cand in candidates:
            if rows >= cap or (tokens is not None and tokens <= 0):
                break  # full: whoever is left is simply next, not rejected
            reason = self._reject_reason(head, cand)
            cand_cap = cap if reason is not None or cand.size_key == head.size_key else self._effective_cap(cand)
            if reason is None and rows + cand.num_outputs > min(cap, cand_cap):
                reason = BATCH_FULL
            if reason is None and tokens is not None and cand.tokens > tokens:
                reason = TOKEN_BUDGET
            more = adapters | {name for name, _ in cand.params.lora}
            if reason is None and self.max_adapters is not None and len(more) > self.max_adapters:
                reason = LORA_SLOTS
            if reason is None and memory is not None and cand.activation_bytes > memory:
                reason = ACTIVATION_MEMORY
            if reason is not None:
                rejects[reason] = rejects.get(reason, 0) + 1
                continue
            batch.append(cand)
            rows, cap = rows + cand.num_outputs, min(cap, cand_cap)
            tokens = None if tokens is None else tokens - cand.tokens
            memory = None if memory is None else memory - cand.activation_bytes
            adapters = more
        return batch, rejects, cap

    def _tokens_full(self, batch: Sequence[Request]) -> bool:
        """Rule 4: the token budget left holds no further row of the batch's smallest size (a single request over
        the budget is full on its own: rule 6)."""
        if self.token_budget is None:
            return False
        left = self.token_budget - sum(r.tokens for r in batch)
        return left < min(r.tokens_per_row for r in batch)

    def class_key(self, request: Request) -> Hashable:
        """Rule 10's class: what must match to share a batch (an ineligible request is a class of its own)."""
        reason = self._ineligible_reason(request)
        if reason is not None:
            return (request.model, reason, request.request_id)
        free = row_fields(request.params, packs=self.packs_mixed_sizes, strength=self.strength_per_row)
        return (request.model, tuple(item for item in request.params.signature() if item[0] not in free))

    def _pick_head(self, ordered: list[Request], anchor: Request | None = None) -> Request:
        """Rule 2's anchor: the head of the queue (`fifo`), or under `drr` the oldest request of the class whose
        turn it is among the requests of the best priority (rule 10); `anchor` when the caller chose it."""
        self._turn = None
        if anchor is not None:
            return anchor
        if self.config.order != "drr" or not self.config.dynamic:
            return ordered[0]
        heads: dict[Hashable, Request] = {}
        for request in ordered:
            if request.priority != ordered[0].priority:
                break
            heads.setdefault(self.class_key(request), request)
        if len(heads) == 1:
            return ordered[0]
        self._turn = self._fair.plan({key: tokens_x_steps(r) for key, r in heads.items()})
        return heads[self._turn.key]

    def _alike(self, head: Request, other: Request) -> bool:
        """Whether `other`'s batch ran what `head` would run (rule 8: its clients' next requests may join)."""
        return self._reject_reason(head, other) is None

    def _reject_reason(self, head: Request, cand: Request) -> str | None:
        """Why `cand` may not share a batch with `head` (rules are covered by the head's cap: a
        compatible candidate has the same model and shape, hence the same matching rules)."""
        ineligible = self._ineligible_reason(cand)
        if ineligible is not None:
            return ineligible
        if cand.model != head.model:
            return MODEL_MISMATCH
        free = row_fields(head.params, cand.params, packs=self.packs_mixed_sizes, strength=self.strength_per_row)
        return signature_difference(head.params, cand.params, free)

    def _dispatch(
        self, requests: list[Request], cap: int, reason: str, rejects: dict[str, int], now: float
    ) -> Dispatch:
        for request in requests:
            self._pop(request.request_id)
            request.status = RequestStatus.RUNNING
        if self._turn is not None:
            self._fair.commit(self._turn, sum(tokens_x_steps(r) for r in requests))
            self._turn = None
        if len(requests) == 1 and self.token_budget is not None and requests[0].tokens > self.token_budget:
            cap = min(cap, max(1, self.token_budget // requests[0].tokens_per_row))  # rule 6: calls within the budget
        self._num_dispatched += 1
        batch = ScheduledBatch(
            requests=requests,
            effective_cap=cap,
            user_max=self.config.max_size,
            num_outputs=sum(r.num_outputs for r in requests),
            stop_reason=reason,
            head_queue_wait_s=max(0.0, now - requests[0].arrival_time),
            rejects=rejects,
            dispatch_time=now,
            batch_id=self._num_dispatched,
            token_budget=self.token_budget,
            **batch_facts(requests),
        )
        self._running.append(batch)
        return Dispatch(batch)
