"""The pure scheduler, driven by real Request/SamplingParams objects and a fake clock (plain floats)."""

from __future__ import annotations

import pytest

from diffuserve.config.batching_rules import BatchingRule, BatchingRules
from diffuserve.engine.request import Request, RequestStatus
from diffuserve.engine.scheduler import (
    BatchingConfig,
    Dispatch,
    Idle,
    RequestLevelScheduler,
    ScheduledBatch,
    WaitUntil,
)
from diffuserve.errors import ConfigError
from diffuserve.sampling import SamplingParams

MODEL = "tiny-flux"


def req(
    rid: str,
    t: float,
    *,
    n: int = 1,
    priority: int = 0,
    deadline: float | None = None,
    ineligible: str | None = None,
    model: str = MODEL,
    **params: object,
) -> Request:
    return Request(
        request_id=rid,
        params=SamplingParams(prompt=f"prompt {rid}", seed=hash(rid) % 1000, n=n, **params),  # type: ignore[arg-type]
        arrival_time=t,
        model=model,
        priority=priority,
        deadline=deadline,
        ineligible_reason=ineligible,
    )


def batcher(
    max_size: int = 8,
    delay_ms: float = 0.0,
    *,
    mode: str = "dynamic",
    rules: BatchingRules | None = None,
    supports_batching: bool = True,
) -> RequestLevelScheduler:
    config = BatchingConfig(mode=mode, max_size=max_size, delay_ms=delay_ms, rules=rules)
    return RequestLevelScheduler(config, model_names=[MODEL, "/ckpt/tiny-flux"], supports_batching=supports_batching)


def dispatched(decision: object) -> ScheduledBatch:
    assert isinstance(decision, Dispatch), f"expected a Dispatch, got {decision!r}"
    return decision.batch


def rules(*items: dict) -> BatchingRules:
    return BatchingRules(schema_version=1, rules=tuple(BatchingRule(**i) for i in items))


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"max_size": 0}, "--batching-max-size"),
        ({"delay_ms": -1.0}, "--batching-delay-ms"),
        ({"delay_ms": float("nan")}, "--batching-delay-ms"),
        ({"mode": "greedy"}, "--batching-mode"),
    ],
)
def test_config_validate_names_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        BatchingConfig(**kwargs).validate()
    with pytest.raises(ConfigError, match=flag):
        RequestLevelScheduler(BatchingConfig(**kwargs), model_names=[MODEL])


def test_config_defaults_are_singleton_serving() -> None:
    config = BatchingConfig()
    config.validate()
    assert (config.mode, config.max_size, config.delay_ms, config.rules) == ("singleton", 1, 0.0, None)
    assert not config.dynamic


# -- basic flow -------------------------------------------------------------------------------------
def test_empty_queue_is_idle_not_busy() -> None:
    assert batcher().schedule(0.0) == Idle(busy=False)


def test_delay_expiry_waits_for_head_then_dispatches_what_is_there() -> None:
    b = batcher(max_size=8, delay_ms=10.0)
    b.add(req("a", 1.000))
    b.add(req("b", 1.004))
    decision = b.schedule(1.005)
    assert isinstance(decision, WaitUntil)
    assert decision.time == pytest.approx(1.010)
    assert b.num_queued == 2  # waiting does not take anything out of the queue
    batch = dispatched(b.schedule(1.0101))
    assert batch.request_ids == ["a", "b"]
    assert batch.stop_reason == "delay"
    assert (batch.effective_cap, batch.user_max, batch.num_outputs) == (8, 8, 2)
    assert batch.head_queue_wait_s == pytest.approx(0.0101)
    assert not batch.is_full
    assert all(r.status is RequestStatus.RUNNING for r in batch.requests)
    assert b.num_queued == 0 and b.running is batch


def test_zero_delay_dispatches_at_once_with_reason_delay() -> None:
    b = batcher(max_size=8, delay_ms=0.0)
    b.add(req("a", 0.0))
    batch = dispatched(b.schedule(0.0))
    assert batch.request_ids == ["a"] and batch.stop_reason == "delay"


def test_one_batch_in_flight_and_complete_releases() -> None:
    b = batcher(max_size=2)
    for i in range(3):
        b.add(req(f"r{i}", 0.0))
    first = dispatched(b.schedule(0.0))
    assert first.request_ids == ["r0", "r1"] and first.stop_reason == "max_size" and first.is_full
    assert b.schedule(0.1) == Idle(busy=True)
    with pytest.raises(ValueError, match="running batch"):
        b.complete(ScheduledBatch([], 1, 1, 0, "delay", 0.0, batch_id=99))
    b.complete(first)
    assert b.running is None
    second = dispatched(b.schedule(0.2))
    assert second.request_ids == ["r2"] and second.batch_id == first.batch_id + 1


def test_duplicate_request_id_is_refused() -> None:
    b = batcher()
    b.add(req("a", 0.0))
    with pytest.raises(ValueError, match="'a'"):
        b.add(req("a", 0.1))


# -- caps and stop reasons --------------------------------------------------------------------------
def test_max_size_stops_the_batch_and_leaves_the_rest_queued() -> None:
    b = batcher(max_size=4, delay_ms=1000.0)
    for i in range(6):
        b.add(req(f"r{i}", i * 0.001))
    batch = dispatched(b.schedule(0.006))  # long delay, but the batch is full: no waiting
    assert batch.request_ids == ["r0", "r1", "r2", "r3"]
    assert batch.stop_reason == "max_size" and batch.rejects == {}
    assert b.num_queued == 2


def test_rule_caps_the_batch_with_config_cap_reason() -> None:
    b = batcher(
        max_size=8, delay_ms=1000.0, rules=rules({"model_contains": "TINY", "resolution": "64x64", "max_batch_size": 2})
    )
    for i in range(3):
        b.add(req(f"r{i}", 0.0))
    batch = dispatched(b.schedule(0.0))
    assert batch.request_ids == ["r0", "r1"]
    assert (batch.effective_cap, batch.user_max, batch.stop_reason) == (2, 8, "config_cap:2")


def test_rule_cap_of_one_and_rule_above_user_max() -> None:
    b = batcher(max_size=4, rules=rules({"model": MODEL, "max_batch_size": 1}, {"model": "other", "max_batch_size": 1}))
    b.add(req("a", 0.0))
    b.add(req("b", 0.0))
    assert dispatched(b.schedule(0.0)).stop_reason == "config_cap:1"

    loose = batcher(max_size=2, rules=rules({"model_contains": "tiny", "max_batch_size": 16}))
    loose.add(req("a", 0.0))
    loose.add(req("b", 0.0))
    batch = dispatched(loose.schedule(0.0))
    assert (batch.effective_cap, batch.stop_reason) == (2, "max_size")


def test_rule_for_another_resolution_does_not_apply() -> None:
    b = batcher(max_size=3, rules=rules({"model_contains": "tiny", "resolution": "128x128", "max_batch_size": 1}))
    for i in range(3):
        b.add(req(f"r{i}", 0.0))
    batch = dispatched(b.schedule(0.0))
    assert (batch.num_requests, batch.stop_reason) == (3, "max_size")


def test_n_counts_against_the_cap_and_a_misfit_is_skipped() -> None:
    b = batcher(max_size=4, delay_ms=50.0)
    b.add(req("a", 0.0, n=2))
    b.add(req("big", 0.001, n=3))  # 2 + 3 > 4: skipped, stays queued
    b.add(req("c", 0.002, n=2))  # 2 + 2 = 4: joins from behind the misfit
    batch = dispatched(b.schedule(0.003))
    assert batch.request_ids == ["a", "c"]
    assert (batch.num_outputs, batch.stop_reason) == (4, "max_size")
    assert batch.rejects == {"batch_full": 1}
    assert b.is_queued("big") and b.num_queued_outputs == 3


def test_oversized_head_runs_alone_instead_of_starving() -> None:
    b = batcher(max_size=4, delay_ms=1000.0)
    b.add(req("huge", 0.0, n=6))
    b.add(req("small", 0.0))
    batch = dispatched(b.schedule(0.0))
    assert batch.request_ids == ["huge"]
    assert (batch.num_outputs, batch.effective_cap, batch.stop_reason) == (6, 4, "max_size")
    assert batch.is_full


def test_singleton_mode_is_dynamic_disabled() -> None:
    for b in (batcher(max_size=8, mode="singleton", delay_ms=100.0), batcher(max_size=1, delay_ms=100.0)):
        b.add(req("a", 0.0))
        b.add(req("b", 0.0))
        batch = dispatched(b.schedule(0.0))  # no waiting when merging is off
        assert batch.request_ids == ["a"]
        assert (batch.stop_reason, batch.effective_cap, batch.rejects) == ("dynamic_disabled", 1, {})


# -- compatibility ----------------------------------------------------------------------------------
def test_per_row_fields_do_not_block_merging() -> None:
    b = batcher(max_size=3)
    b.add(req("a", 0.0, negative_prompt=None, output_format="png"))
    b.add(req("b", 0.0, output_format="jpeg", output_quality=50, fps=8))
    b.add(req("c", 0.0, n=1))
    assert dispatched(b.schedule(0.0)).request_ids == ["a", "b", "c"]


def test_different_steps_never_merge() -> None:
    b = batcher(max_size=8, delay_ms=5.0)
    b.add(req("s4", 0.0, num_inference_steps=4))
    b.add(req("s8", 0.001, num_inference_steps=8))
    b.add(req("s4b", 0.002, num_inference_steps=4))
    first = dispatched(b.schedule(0.005))
    assert first.request_ids == ["s4", "s4b"]
    assert first.rejects == {"sampling_params.num_inference_steps": 1}
    b.complete(first)
    second = dispatched(b.schedule(0.01))
    assert second.request_ids == ["s8"]


def test_out_of_order_compatible_pickup_and_incompatible_never_ahead_of_head() -> None:
    b = batcher(max_size=8, delay_ms=0.0)
    b.add(req("a", 0.0, width=64))
    b.add(req("x1", 0.001, width=128))
    b.add(req("x2", 0.002, width=128, guidance_scale=7.0))
    b.add(req("b", 0.003, width=64))
    first = dispatched(b.schedule(0.004))
    assert first.request_ids == ["a", "b"]  # b jumps x1/x2 to join its head
    assert first.rejects == {"sampling_params.width": 2}
    b.complete(first)
    # x1 is now the head; x2 differs from it in guidance and stays behind it.
    second = dispatched(b.schedule(0.005))
    assert second.request_ids == ["x1"]
    assert second.rejects == {"sampling_params.guidance_scale": 1}


def test_ineligible_head_runs_alone_at_once() -> None:
    b = batcher(max_size=8, delay_ms=1000.0)
    b.add(req("edit", 0.0, ineligible="image_conditioning"))
    b.add(req("t2i", 0.0))
    batch = dispatched(b.schedule(0.0))
    assert batch.request_ids == ["edit"]
    assert batch.stop_reason == "head:image_conditioning"


def test_ineligible_candidate_is_rejected_by_its_reason() -> None:
    b = batcher(max_size=8, delay_ms=0.0)
    b.add(req("a", 0.0))
    b.add(req("edit", 0.0, ineligible="image_conditioning"))
    b.add(req("warm", 0.0, ineligible="warmup"))
    b.add(req("other", 0.0, model="another-model"))
    batch = dispatched(b.schedule(0.0))
    assert batch.request_ids == ["a"]
    assert batch.rejects == {"image_conditioning": 1, "warmup": 1, "model": 1}


def test_family_without_batching_makes_every_head_ineligible() -> None:
    b = batcher(max_size=8, delay_ms=100.0, supports_batching=False)
    b.add(req("a", 0.0))
    b.add(req("b", 0.0))
    batch = dispatched(b.schedule(0.0))
    assert batch.request_ids == ["a"] and batch.stop_reason == "head:family_unsupported"


# -- abort / expire / drain -------------------------------------------------------------------------
def test_abort_inside_a_forming_batch() -> None:
    b = batcher(max_size=4, delay_ms=10.0)
    b.add(req("a", 0.0))
    b.add(req("b", 0.001))
    b.add(req("c", 0.002))
    assert isinstance(b.schedule(0.003), WaitUntil)
    gone = b.abort("b")
    assert gone is not None and gone.status is RequestStatus.ABORTED
    assert b.abort("b") is None and b.abort("nope") is None
    batch = dispatched(b.schedule(0.010))
    assert batch.request_ids == ["a", "c"] and batch.stop_reason == "delay"
    assert b.abort("a") is None  # running requests are cancelled by the engine, not the queue


def test_abort_of_the_head_reanchors_on_the_next_arrival() -> None:
    b = batcher(max_size=4, delay_ms=10.0)
    b.add(req("a", 0.0))
    b.add(req("b", 0.005))
    b.abort("a")
    decision = b.schedule(0.011)  # a's delay would have expired; b's has not
    assert isinstance(decision, WaitUntil) and decision.time == pytest.approx(0.015)


def test_expire_removes_only_past_deadlines() -> None:
    b = batcher(max_size=4, delay_ms=100.0)
    b.add(req("soon", 0.0, deadline=1.0))
    b.add(req("later", 0.0, deadline=5.0))
    b.add(req("never", 0.0, n=2))
    assert b.next_deadline() == 1.0
    assert b.expire(0.5) == []
    expired = b.expire(1.0)
    assert [r.request_id for r in expired] == ["soon"]
    assert expired[0].status is RequestStatus.TIMED_OUT
    assert b.num_queued == 2 and b.num_queued_outputs == 3 and b.next_deadline() == 5.0


def test_drain_returns_everything_in_order() -> None:
    b = batcher(max_size=2)
    b.add(req("late", 2.0))
    b.add(req("early", 1.0))
    b.add(req("urgent", 3.0, priority=-1))
    drained = b.drain()
    assert [r.request_id for r in drained] == ["urgent", "early", "late"]
    assert b.num_queued == 0 and b.num_queued_outputs == 0 and b.schedule(4.0) == Idle()


# -- priority ---------------------------------------------------------------------------------------
def test_priority_picks_the_head_and_orders_candidates() -> None:
    b = batcher(max_size=2, delay_ms=0.0)
    b.add(req("p1_first", 0.0, priority=1))
    b.add(req("p0_second", 0.001, priority=0))
    b.add(req("p1_third", 0.002, priority=1))
    b.add(req("p0_fourth", 0.003, priority=0))
    first = dispatched(b.schedule(0.004))
    assert first.request_ids == ["p0_second", "p0_fourth"]
    b.complete(first)
    second = dispatched(b.schedule(0.005))
    assert second.request_ids == ["p1_first", "p1_third"]


def test_priority_head_waits_from_its_own_arrival() -> None:
    b = batcher(max_size=4, delay_ms=10.0)
    b.add(req("low", 0.0, priority=5))
    b.add(req("high", 0.008, priority=0, num_inference_steps=9))
    decision = b.schedule(0.012)  # low's delay is over, but high is the head now
    assert isinstance(decision, WaitUntil) and decision.time == pytest.approx(0.018)
    batch = dispatched(b.schedule(decision.time))  # waking exactly at the returned time dispatches
    assert batch.request_ids == ["high"]
    assert batch.rejects == {"sampling_params.num_inference_steps": 1}


# -- rule 8: answers bring requests ------------------------------------------------------------------
def test_a_batch_below_the_cap_waits_for_a_like_batch_still_decoding_then_for_its_clients() -> None:
    b = batcher(max_size=8, delay_ms=5.0)
    for i in range(4):
        b.add(req(f"a{i}", 0.0))
    first = dispatched(b.schedule(0.005))  # 4 closed-loop clients, the first batch of the rest of them
    b.add(req("late", 0.010))  # queued while `first` denoised: its head has waited past the delay
    b.complete(first)
    b.note_answering(first)  # `first` decodes in the decode lane
    assert b.schedule(0.020) == Idle(busy=True)  # not formed before first's answers are out
    b.note_answered(first, 0.030)
    decision = b.schedule(0.031)  # the head waits the delay from the answers, for first's clients
    assert isinstance(decision, WaitUntil) and decision.time == pytest.approx(0.035)
    b.add(req("b0", 0.034))  # a busy host: they come back late, a few ms apart; each arrival extends the wait
    b.add(req("b1", 0.038))
    b.add(req("b2", 0.041))
    decision = b.schedule(0.042)
    assert isinstance(decision, WaitUntil) and decision.time == pytest.approx(0.046)
    b.add(req("b3", 0.043))  # all four are back: nothing more to wait for
    second = dispatched(b.schedule(0.043))
    assert second.request_ids == ["late", "b0", "b1", "b2", "b3"] and second.stop_reason == "delay"


def test_once_the_answered_clients_stop_coming_the_batch_goes() -> None:
    b = batcher(max_size=8, delay_ms=5.0)
    b.add(req("a0", 0.0))
    b.add(req("a1", 0.0))
    first = dispatched(b.schedule(0.005))
    b.complete(first)
    b.note_answered(first, 0.010)  # answered inline (no decode lane)
    b.add(req("b0", 0.011))  # one client came back, the other went away
    assert b.schedule(0.012) == WaitUntil(pytest.approx(0.016))
    assert dispatched(b.schedule(0.016)).request_ids == ["b0"]


def test_rule_8_leaves_unlike_heads_and_zero_delay_alone() -> None:
    b = batcher(max_size=8, delay_ms=5.0)
    b.add(req("a", 0.0))
    first = dispatched(b.schedule(0.005))
    b.complete(first)
    b.note_answering(first)
    b.add(req("other", 0.010, num_inference_steps=7))  # another signature: first's clients could not join it
    assert dispatched(b.schedule(0.020)).request_ids == ["other"]
    b.note_answered(first, 0.021)
    b.complete(b.running)
    b.add(req("unlike", 0.022, num_inference_steps=7))
    assert dispatched(b.schedule(0.027)).request_ids == ["unlike"]  # rule 5 alone: arrival + delay
    z = batcher(max_size=8, delay_ms=0.0)
    z.add(req("a", 0.0))
    first = dispatched(z.schedule(0.0))
    z.complete(first)
    z.note_answering(first)
    z.add(req("b", 0.001))
    assert dispatched(z.schedule(0.002)).request_ids == ["b"]  # no delay asked: nothing waits


def test_the_wait_after_answers_counts_the_time_clients_took_to_come_back() -> None:
    b = batcher(max_size=8, delay_ms=5.0)
    b.add(req("a0", 0.0))
    b.add(req("a1", 0.0))
    first = dispatched(b.schedule(0.005))
    b.complete(first)
    b.note_answered(first, 0.010)
    b.add(req("b0", 0.022))  # the way back (response, client, next request) took 12 ms
    b.add(req("b1", 0.023))
    second = dispatched(b.schedule(0.027))  # both back: rule 5 alone (the head's own delay)
    b.add(req("late", 0.030))  # a third client's request, queued while `second` runs
    b.complete(second)
    b.note_answered(second, 0.040)
    # Not at 0.045 (the answers + the delay): the clients need ~12 ms to come back, so the head waits for them.
    assert b.schedule(0.041) == WaitUntil(pytest.approx(0.057))
    b.add(req("c0", 0.052))
    b.add(req("c1", 0.053))
    assert dispatched(b.schedule(0.053)).request_ids == ["late", "c0", "c1"]
