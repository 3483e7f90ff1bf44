"""The pure step scheduler of `--batching-mode continuous`, with real Request objects and a fake clock."""

from __future__ import annotations

from diffuserve.config.batching_rules import BatchingRule, BatchingRules
from diffuserve.engine.request import Request, RequestStatus
from diffuserve.engine.scheduler import BatchingConfig, Dispatch, Idle, WaitUntil
from diffuserve.engine.step_scheduler import GROUP_KEY_FIELDS, StepPlan, StepScheduler, group_key
from diffuserve.sampling import SamplingParams
from tests.conftest import log_messages

MODEL = "tiny-flux"


def req(
    rid: str,
    t: float,
    *,
    n: int = 1,
    steps: int = 3,
    deadline: float | None = None,
    ineligible: str | None = None,
    priority: int = 0,
    **params: object,
) -> Request:
    return Request(
        request_id=rid,
        arrival_time=t,
        model=MODEL,
        deadline=deadline,
        ineligible_reason=ineligible,
        priority=priority,
        params=SamplingParams(prompt=rid, seed=1, n=n, num_inference_steps=steps, **params),
    )  # type: ignore[arg-type]


def sched(
    max_size: int = 4, delay_ms: float = 0.0, *, rules: BatchingRules | None = None, supports_continuous: bool = True
) -> StepScheduler:
    config = BatchingConfig(mode="continuous", max_size=max_size, delay_ms=delay_ms, rules=rules)
    return StepScheduler(config, model_names=[MODEL], supports_continuous=supports_continuous)


def step(decision: object) -> StepPlan:
    assert isinstance(decision, StepPlan), f"expected a StepPlan, got {decision!r}"
    return decision


def ids(entries) -> list[str]:
    return [e.request.request_id for e in entries]


def test_rows_join_at_step_boundaries_and_leave_after_their_own_last_step() -> None:
    s = sched()
    s.add(req("a", 0.0, steps=3))
    p1 = step(s.schedule(0.0))
    assert ids(p1.rows) == ["a"] and ids(p1.joined) == ["a"] and p1.step_id == 1
    assert s.step_done(p1) == []
    s.add(req("b", 0.5, steps=2))  # arrives mid-run: joins at the next boundary
    p2 = step(s.schedule(0.5))
    assert ids(p2.rows) == ["a", "b"] and ids(p2.joined) == ["b"]
    assert [e.step_index for e in p2.rows] == [1, 0]
    assert s.step_done(p2) == []
    p3 = step(s.schedule(1.0))
    assert ids(p3.joined) == [] and [e.step_index for e in p3.rows] == [2, 1]
    finished = s.step_done(p3)
    assert ids(finished) == ["a", "b"] and all(e.request.status is RequestStatus.FINISHED for e in finished)
    assert s.schedule(1.5) == Idle()


def test_different_step_counts_share_the_group_and_left_is_reported() -> None:
    s = sched()
    s.add(req("a", 0.0, steps=1))
    s.add(req("b", 0.0, steps=2))
    p1 = step(s.schedule(0.0))
    assert ids(p1.rows) == ["a", "b"]
    assert ids(s.step_done(p1)) == ["a"]
    p2 = step(s.schedule(0.1))
    assert ids(p2.rows) == ["b"] and p2.left == 1


def test_cap_counts_rows_and_strict_order_stops_the_scan() -> None:
    s = sched(max_size=4)
    s.add(req("a", 0.0, n=2))
    s.add(req("b", 0.1, n=3))  # does not fit beside a (2 + 3 > 4)
    s.add(req("c", 0.2, n=1))  # would fit, but may not overtake b
    p = step(s.schedule(0.2))
    assert ids(p.rows) == ["a"] and p.cap == 4 and p.num_rows == 2
    s.step_done(p)
    s.step_done(step(s.schedule(0.3)))
    s.step_done(step(s.schedule(0.4)))  # a finishes after 3 steps
    p = step(s.schedule(0.5))
    assert ids(p.joined) == ["b", "c"] and p.num_rows == 4


def test_rule_caps_lower_the_group_cap() -> None:
    rules = BatchingRules(schema_version=1, rules=(BatchingRule(model=MODEL, max_batch_size=2),))
    s = sched(max_size=8, rules=rules)
    for i in range(3):
        s.add(req(f"r{i}", 0.0))
    p = step(s.schedule(0.0))
    assert p.cap == 2 and ids(p.rows) == ["r0", "r1"]


def test_group_key_separates_shape_guidance_and_cfg_but_not_steps() -> None:
    assert "num_inference_steps" not in GROUP_KEY_FIELDS
    base = req("a", 0.0)
    assert group_key(base) == group_key(req("b", 0.0, steps=7))
    for change in ({"width": 128}, {"guidance_scale": 1.0}, {"true_cfg_scale": 4.0, "negative_prompt": "x"}):
        assert group_key(base) != group_key(req("c", 0.0, **change))
    s = sched()
    s.add(req("a", 0.0))
    s.add(req("b", 0.0, width=128))  # incompatible: waits until the group drains, then anchors its own
    p = step(s.schedule(0.0))
    assert ids(p.rows) == ["a"]
    s.step_done(p)
    s.step_done(step(s.schedule(0.1)))
    s.step_done(step(s.schedule(0.2)))
    assert ids(step(s.schedule(0.3)).joined) == ["b"]


def test_family_key_fields_keep_other_fps_and_silent_requests_out_of_the_group() -> None:
    """LTX-2 declares `continuous_key_fields=("fps", "generate_audio")` (its audio length and whether audio tokens
    exist): a request differing there waits for its own group; without the declaration it joins."""
    fields = ("fps", "generate_audio")
    base = req("a", 0.0, fps=8)
    assert group_key(base) == group_key(req("b", 0.0, fps=12))
    for change in ({"fps": 12}, {"fps": 8, "generate_audio": False}):
        assert group_key(base, family_fields=fields) != group_key(req("c", 0.0, **change), family_fields=fields)
    s = sched()
    s.set_capabilities(supports_batching=True, supports_continuous=True, continuous_key_fields=fields)
    s.add(req("a", 0.0, fps=8))
    s.add(req("b", 0.0, fps=12))
    assert ids(step(s.schedule(0.0)).rows) == ["a"]
    s = sched()
    s.set_capabilities(supports_batching=True, supports_continuous=True)
    s.add(req("a", 0.0, fps=8))
    s.add(req("b", 0.0, fps=12))
    assert ids(step(s.schedule(0.0)).rows) == ["a", "b"]


def test_delay_waits_for_companions_only_when_the_group_is_empty() -> None:
    s = sched(max_size=4, delay_ms=100.0)
    s.add(req("a", 0.0))
    assert s.schedule(0.05) == WaitUntil(0.1)
    s.add(req("b", 0.06))
    p = step(s.schedule(0.1))
    assert ids(p.rows) == ["a", "b"]
    s.step_done(p)
    s.add(req("c", 0.2))  # the group runs: c joins at once, without a delay
    assert ids(step(s.schedule(0.2)).joined) == ["c"]


def test_full_group_starts_without_waiting_out_the_delay() -> None:
    s = sched(max_size=2, delay_ms=1000.0)
    s.add(req("a", 0.0))
    s.add(req("b", 0.0))
    assert ids(step(s.schedule(0.0)).rows) == ["a", "b"]


def test_cancelled_and_expired_rows_leave_at_the_next_step() -> None:
    s = sched()
    a, b, c = req("a", 0.0, steps=5), req("b", 0.0, steps=5, deadline=1.0), req("c", 0.0, steps=5)
    for r in (a, b, c):
        s.add(r)
    s.step_done(step(s.schedule(0.0)))
    a.cancel_event.set()
    p = step(s.schedule(2.0))
    assert p.removed == [(a, "cancelled"), (b, "deadline")] and ids(p.rows) == ["c"] and p.left == 2
    assert a.status is RequestStatus.ABORTED and b.status is RequestStatus.TIMED_OUT
    c.cancel_event.set()
    p = step(s.schedule(2.1))
    assert p.rows == [] and p.removed == [(c, "cancelled")]
    assert s.schedule(2.2) == Idle()


def test_failed_step_removes_its_rows() -> None:
    s = sched()
    s.add(req("a", 0.0))
    p = step(s.schedule(0.0))
    assert ids(s.fail(p.rows)) == ["a"] and s.group == [] and p.rows[0].request.status is RequestStatus.FAILED
    assert s.schedule(0.1) == Idle()


def test_ineligible_heads_and_non_continuous_families_use_request_level_batches() -> None:
    s = sched()
    s.add(req("edit", 0.0, ineligible="image_conditioning"))
    d = s.schedule(0.0)
    assert isinstance(d, Dispatch) and d.batch.request_ids == ["edit"]
    s.add(req("b", 0.1))
    assert s.schedule(0.1) == Idle(busy=True)  # the request-level batch runs
    s.complete(d.batch)
    assert ids(step(s.schedule(0.2)).rows) == ["b"]
    s2 = sched(supports_continuous=False)
    s2.add(req("x", 0.0))
    s2.add(req("y", 0.0))
    d2 = s2.schedule(0.0)
    assert isinstance(d2, Dispatch) and d2.batch.request_ids == ["x", "y"]  # dynamic merging instead


def test_ids_stay_unique_across_queue_and_group() -> None:
    s = sched()
    s.add(req("a", 0.0))
    step(s.schedule(0.0))
    try:
        s.add(req("a", 0.1))
    except ValueError as exc:
        assert "already running" in str(exc)
    else:
        raise AssertionError("a duplicate id was accepted")


def test_continuous_step_line_and_collectors(caplog) -> None:
    import logging

    from diffuserve.engine.metrics import ContinuousStats, EngineMetrics, format_step

    assert format_step(3, 4, 1, 0, 2) == "Continuous denoising step batch: size=3/4, joined=1, left=0, active=2"
    metrics = EngineMetrics()
    stats = ContinuousStats(metrics, log_enabled=True, window=2)
    with caplog.at_level(logging.INFO, logger="diffuserve.batching"):
        stats.record_step(3, 4, 1, 0, 2)
        stats.record_step(1, 4, 0, 1, 1)
        stats.record_leave("finished", 2)
    messages = log_messages(caplog)
    assert messages[-1] == (
        "Continuous denoising stats (last 2 steps): avg_size=2.00, utilization=50.0%, joins=1, leaves=1"
    )
    get = metrics.registry.get_sample_value
    assert get("diffuserve_continuous_joins_total") == 1
    assert get("diffuserve_continuous_leaves_total", {"reason": "finished"}) == 2
    assert get("diffuserve_continuous_step_batch_rows_count") == 2
    assert get("diffuserve_continuous_active_rows") == 1


def test_a_request_still_starting_holds_its_rows_but_does_not_step() -> None:
    """The engine starts a joiner beside the loop (its encode): until it is ready it keeps its place and its rows of
    the cap, and `step_done` advances only the rows that stepped."""
    s = sched(max_size=2)
    s.add(req("a", 0.0, steps=3))
    p1 = step(s.schedule(0.0))
    s.step_done(p1)
    s.add(req("b", 0.1, steps=2))
    p2 = step(s.schedule(0.1))
    (b,) = p2.joined
    b.ready = False  # what the engine does while b's encode runs
    s.add(req("c", 0.2))
    ready = [e for e in p2.rows if e.ready]
    assert s.step_done(p2, ready) == []
    assert [(e.request.request_id, e.step_index) for e in s.group] == [("a", 2), ("b", 0)]
    p3 = step(s.schedule(0.3))
    assert p3.joined == [] and s.num_active_rows == 2  # c waits: b's rows count against the cap of 2
    b.ready = True
    assert ids(s.step_done(p3)) == ["a"]
    assert [(e.request.request_id, e.step_index) for e in s.group] == [("b", 1)]


def test_a_group_holds_at_most_max_adapters_distinct_adapters() -> None:
    """`--max-loras` 2 (the device slots each step's rows must fit in): a joiner whose adapters would make a third
    waits, and the scan stops there (strict order); it joins once rows with other adapters left, or anchors the next
    group. Without the cap the same queue would all join."""
    a, b, c = (("a", 1.0),), (("b", 1.0),), (("c", 0.5),)
    config = BatchingConfig(mode="continuous", max_size=8, delay_ms=0, max_adapters=2)
    s = StepScheduler(config, model_names=[MODEL])
    s.add(req("ab", 0.0, steps=1, lora=a + b))
    s.add(req("a", 0.1, steps=3, lora=a))
    s.add(req("c", 0.2, steps=1, lora=c))  # a third adapter: waits
    s.add(req("plain", 0.3, steps=1))  # behind it in strict order: waits too
    p1 = step(s.schedule(1.0))
    assert ids(p1.rows) == ["ab", "a"]
    assert ids(s.step_done(p1)) == ["ab"]  # b leaves with it: the group holds a only
    p2 = step(s.schedule(1.1))
    assert ids(p2.joined) == ["c", "plain"] and ids(p2.rows) == ["a", "c", "plain"]
    uncapped = StepScheduler(BatchingConfig(mode="continuous", max_size=8, delay_ms=0), model_names=[MODEL])
    for r in (req("ab", 0.0, lora=a + b), req("a", 0.1, lora=a), req("c", 0.2, lora=c)):
        uncapped.add(r)
    assert ids(step(uncapped.schedule(1.0)).rows) == ["ab", "a", "c"]


def test_a_group_start_waits_for_companions_only_within_the_adapter_cap() -> None:
    """With a delay, the head waits for companions unless the group is full; a queued request the cap keeps out
    does not count towards filling it."""
    config = BatchingConfig(mode="continuous", max_size=2, delay_ms=100, max_adapters=1)
    s = StepScheduler(config, model_names=[MODEL])
    s.add(req("a", 0.0, lora=(("a", 1.0),)))
    s.add(req("b", 0.0, lora=(("b", 1.0),)))
    assert s.schedule(0.01) == WaitUntil(0.1)  # b cannot join: the group is not full
    assert ids(step(s.schedule(0.1)).rows) == ["a"]
