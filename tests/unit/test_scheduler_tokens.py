"""Scheduling by cost (issue 31): the token budget, mixed sizes for families that pack them, deficit round-robin
across waiting shapes, and the budget's bad-input rules; the pure schedulers with a fake clock (plain floats)."""

from __future__ import annotations

from collections import Counter

import pytest

from diffuserve.config.token_budget import check_max_tokens, largest_size, resolve_token_budget, row_tokens
from diffuserve.engine.fair_order import DeficitRoundRobin
from diffuserve.engine.request import Request
from diffuserve.engine.scheduler import (
    TOKEN_BUDGET,
    BatchingConfig,
    Dispatch,
    Idle,
    RequestLevelScheduler,
    ScheduledBatch,
    WaitUntil,
)
from diffuserve.engine.step_scheduler import StepPlan, StepScheduler
from diffuserve.errors import ConfigError
from diffuserve.sampling import SamplingParams

MODEL = "tiny-flux"
T512 = 1024
"""Latent tokens of one 512x512 row at the default 16-pixel token side."""


def req(rid: str, t: float, size: int | tuple[int, int] = 512, *, n: int = 1, steps: int = 4, **kw: object) -> Request:
    width, height = (size, size) if isinstance(size, int) else size
    params = SamplingParams(prompt=rid, seed=1, n=n, width=width, height=height, num_inference_steps=steps)
    return Request(request_id=rid, params=params, arrival_time=t, model=MODEL, **kw)  # type: ignore[arg-type]


def batcher(
    max_size: int = 8, *, tokens: int | None = None, packs: bool = False, order: str = "fifo", delay_ms: float = 0.0
) -> RequestLevelScheduler:
    config = BatchingConfig(mode="dynamic", max_size=max_size, max_tokens=tokens, order=order, delay_ms=delay_ms)
    b = RequestLevelScheduler(config, model_names=[MODEL])
    b.set_capabilities(supports_batching=True, packs_mixed_sizes=packs)
    return b


def dispatched(decision: object) -> ScheduledBatch:
    assert isinstance(decision, Dispatch), f"expected a Dispatch, got {decision!r}"
    return decision.batch


def test_row_tokens_follow_the_latent_geometry() -> None:
    assert req("a", 0.0, 512).tokens == T512 and req("a", 0.0, 512, n=3).tokens == 3 * T512
    assert req("a", 0.0, (512, 768)).tokens == 32 * 48
    assert row_tokens(1024, 1024, token_side=16) == 4096 and row_tokens(1024, 1024, token_side=32) == 1024
    assert row_tokens(832, 480, 81, token_side=16, frames_per_latent=4) == 52 * 30 * 21  # Wan: 81 frames -> 21
    explicit = req("b", 0.0, 512, row_tokens=256)  # the engine's count on the served model wins
    assert explicit.tokens_per_row == 256


def test_without_packing_the_size_stays_in_the_signature_and_the_row_cap_is_unchanged() -> None:
    b = batcher(max_size=4, tokens=4 * T512)
    for i in range(5):
        b.add(req(f"s{i}", 0.1 * i, 512))
    b.add(req("small", 0.6, 256))
    batch = dispatched(b.schedule(1.0))
    assert batch.request_ids == ["s0", "s1", "s2", "s3"] and batch.stop_reason == "max_size"
    assert batch.num_tokens == 4 * T512 and batch.num_sizes == 1 and batch.padding_tokens == 0 and not batch.packed
    b.complete(batch)
    batch = dispatched(b.schedule(1.0))
    assert batch.request_ids == ["s4"] and batch.rejects == {"sampling_params.width": 1}


def test_packing_mixes_sizes_up_to_the_token_budget() -> None:
    b = batcher(max_size=8, tokens=2 * T512 + 256, packs=True)
    b.add(req("big", 0.0, 512))
    b.add(req("mid", 0.1, 512))
    b.add(req("too-big", 0.2, 512))  # 3 x 1024 > budget: skipped ...
    b.add(req("small", 0.3, 256))  # ... while a smaller size behind it still fits
    batch = dispatched(b.schedule(1.0))
    assert batch.request_ids == ["big", "mid", "small"] and batch.stop_reason == "max_tokens"
    assert batch.rejects == {TOKEN_BUDGET: 1} and batch.num_tokens == 2 * T512 + 256 and batch.num_outputs == 3
    assert batch.packed and batch.num_sizes == 2 and batch.padding_tokens == T512 - 256 and batch.is_full


def test_a_batch_below_the_budget_waits_out_the_delay_and_is_full_when_no_row_fits() -> None:
    b = batcher(max_size=8, tokens=3 * T512, packs=True, delay_ms=100.0)
    b.add(req("a", 0.0, 512))
    b.add(req("b", 0.01, 512))
    assert b.schedule(0.02) == WaitUntil(0.1)  # 1024 tokens left: one more 512 row fits
    b.add(req("c", 0.03, (256, 512)))  # 512 tokens: fits, but 512 more still fit beside it
    assert b.schedule(0.04) == WaitUntil(0.1)
    b.add(req("d", 0.05, (256, 512)))
    batch = dispatched(b.schedule(0.06))  # exactly at the budget: full before the delay ran out
    assert batch.request_ids == ["a", "b", "c", "d"] and batch.stop_reason == "max_tokens"


def test_a_request_over_the_budget_runs_alone_at_once_in_calls_within_the_budget() -> None:
    b = batcher(max_size=8, tokens=2 * T512, packs=True, delay_ms=1000.0)
    b.add(req("huge", 0.0, 512, n=5))  # 5 rows: over the budget on its own, never refused for it
    b.add(req("next", 0.0, 256))
    batch = dispatched(b.schedule(0.0))  # no wait for the delay
    assert batch.request_ids == ["huge"] and batch.stop_reason == "max_tokens"
    assert batch.num_outputs == 5 and batch.effective_cap == 2  # the batch runner splits it: 2 + 2 + 1 rows
    b.complete(batch)
    b.add(req("larger-size", 0.5, 2048))  # a size over the budget: alone too
    assert dispatched(b.schedule(2.0)).request_ids == ["next"]
    b.complete(b.running)  # type: ignore[arg-type]
    batch = dispatched(b.schedule(2.0))
    assert batch.request_ids == ["larger-size"] and batch.effective_cap == 1


def test_packed_batches_keep_the_other_signature_fields_and_rule_caps() -> None:
    b = batcher(max_size=8, tokens=8 * T512, packs=True)
    b.add(req("a", 0.0, 512))
    b.add(req("steps", 0.1, 256, steps=9))
    b.add(req("b", 0.2, 384))
    batch = dispatched(b.schedule(1.0))
    assert batch.request_ids == ["a", "b"] and batch.rejects == {"sampling_params.num_inference_steps": 1}


def _drain(b: RequestLevelScheduler, now: float = 10.0) -> list[list[str]]:
    order = []
    while True:
        decision = b.schedule(now)
        if isinstance(decision, Idle):
            return order
        batch = dispatched(decision)
        order.append(batch.request_ids)
        b.complete(batch)


def _shapes(big_first: bool, order: str) -> RequestLevelScheduler:
    b = batcher(max_size=2, tokens=None, order=order)
    arrivals = [("L1", 1024), ("L2", 1024)] if big_first else []
    arrivals += [(f"S{i}", 512) for i in range(8)]
    for i, (rid, size) in enumerate(arrivals):
        b.add(req(rid, 0.01 * i, size))
    return b


def test_fifo_lets_a_large_head_block_the_small_ones_behind_it() -> None:
    assert _drain(_shapes(True, "fifo"))[0] == ["L1", "L2"]


def test_drr_serves_shapes_by_tokens_x_steps_so_neither_blocks_nor_starves() -> None:
    order = _drain(_shapes(True, "drr"))
    first = order.index(["L1", "L2"])
    # A 1024x1024 batch costs 4 of the 512x512 class's: the small class goes first, then both share by cost,
    # and the large batch runs long before the small queue is empty (no starvation).
    assert order[0][0].startswith("S") and 0 < first < len(order) - 1
    small_before = sum(len(batch) for batch in order[:first])
    assert small_before == 4  # two small batches run while the large class earns the credit for its dearer one
    assert sorted(r for batch in order for r in batch) == sorted(["L1", "L2", *(f"S{i}" for i in range(8))])


def test_drr_with_one_shape_is_fifo_and_priority_stays_strict() -> None:
    assert _drain(_shapes(False, "drr")) == _drain(_shapes(False, "fifo"))
    b = batcher(max_size=2, order="drr")
    b.add(req("low-small", 0.0, 256, priority=1))
    b.add(req("high-big", 0.1, 1024, priority=0))
    assert _drain(b) == [["high-big"], ["low-small"]]


def test_drr_plans_without_changing_state_until_a_dispatch() -> None:
    b = batcher(max_size=4, order="drr", delay_ms=100.0)
    b.add(req("L", 0.0, 1024))
    b.add(req("S", 0.01, 512))
    first = b.schedule(0.02)
    assert first == b.schedule(0.03) == WaitUntil(0.11)  # the small class's head waits its delay, twice the same
    assert dispatched(b.schedule(0.2)).request_ids == ["S"]


def test_deficit_round_robin_shares_cost_evenly() -> None:
    fair = DeficitRoundRobin()
    served: Counter[str] = Counter()
    costs = {"big": 4.0, "small": 1.0}
    for _ in range(40):
        turn = fair.plan(costs)
        fair.commit(turn, costs[turn.key])
        served[turn.key] += costs[turn.key]
    assert abs(served["big"] - served["small"]) <= costs["big"]


def step(decision: object) -> StepPlan:
    assert isinstance(decision, StepPlan), f"expected a StepPlan, got {decision!r}"
    return decision


def sched(*, packs: bool, tokens: int | None, max_size: int = 8, order: str = "fifo") -> StepScheduler:
    config = BatchingConfig(mode="continuous", max_size=max_size, max_tokens=tokens, order=order)
    s = StepScheduler(config, model_names=[MODEL])
    s.set_capabilities(supports_batching=True, supports_continuous=True, packs_mixed_sizes=packs)
    return s


def test_a_request_of_another_size_joins_the_running_group_when_the_family_packs() -> None:
    s = sched(packs=True, tokens=2 * T512)
    s.add(req("a", 0.0, 512, steps=2))
    first = step(s.schedule(0.0))
    assert [e.request.request_id for e in first.rows] == ["a"]
    s.step_done(first)
    s.add(req("b", 0.1, 256))
    s.add(req("c", 0.2, 512))
    plan = step(s.schedule(0.2))
    assert [e.request.request_id for e in plan.joined] == ["b"]  # c's 1024 tokens do not fit beside a and b
    assert plan.num_tokens == T512 + 256
    s.step_done(plan)  # a's last step: it leaves
    plan = step(s.schedule(0.3))
    assert [e.request.request_id for e in plan.joined] == ["c"] and plan.num_tokens == 256 + T512


def test_without_packing_another_size_waits_for_its_own_group() -> None:
    s = sched(packs=False, tokens=None)
    s.add(req("a", 0.0, 512, steps=1))
    s.add(req("b", 0.0, 256, steps=1))
    plan = step(s.schedule(0.0))
    assert [e.request.request_id for e in plan.rows] == ["a"]
    s.step_done(plan)
    assert [e.request.request_id for e in step(s.schedule(0.1)).rows] == ["b"]


def test_a_request_over_the_token_budget_starts_alone_in_an_empty_group() -> None:
    s = sched(packs=True, tokens=T512)
    s.add(req("big", 0.0, 1024, steps=1))
    s.add(req("small", 0.0, 256, steps=1))
    plan = step(s.schedule(0.0))
    assert [e.request.request_id for e in plan.rows] == ["big"]
    s.step_done(plan)
    assert [e.request.request_id for e in step(s.schedule(0.1)).rows] == ["small"]


def _large_behind_a_group(order: str) -> StepScheduler:
    """A packed group (budget: four 512x512 rows) runs `a`; then a 1024x1024 request (the whole budget) and three
    512x512 ones arrive, all of 4 steps: the large one costs 4 of the small class's tokens x steps. The three small
    ones fit beside `a`."""
    s = sched(packs=True, tokens=4 * T512, order=order)
    s.add(req("a", 0.0, 512, steps=2))
    s.step_done(step(s.schedule(0.0)))
    s.add(req("L", 0.1, 1024))
    for i in range(3):
        s.add(req(f"S{i}", 0.2 + 0.01 * i, 512))
    return s


def test_continuous_fifo_lets_a_large_request_block_the_small_ones_behind_it() -> None:
    assert step(_large_behind_a_group("fifo").schedule(0.3)).joined == []


def test_continuous_drr_lets_small_sizes_join_while_the_large_class_earns_its_turn() -> None:
    plan = step(_large_behind_a_group("drr").schedule(0.3))
    # The small class runs while the large one earns a small head's cost per visit: its turn comes after three.
    assert [e.request.request_id for e in plan.joined] == ["S0", "S1", "S2"]


def test_continuous_drr_holds_the_others_back_once_the_large_turn_comes_so_it_never_starves() -> None:
    s = _large_behind_a_group("drr")
    entered: list[str] = []
    for t in range(12):
        s.add(req(f"late{t}", 0.3 + t, 512))  # a steady stream of small requests
        plan = step(s.schedule(0.3 + t))
        entered += [e.request.request_id for e in plan.joined]
        s.step_done(plan)
        if "L" in entered:
            break
    assert entered[:4] == ["S0", "S1", "S2", "L"]  # nothing joined past it while it waited for room


def test_continuous_drr_with_one_size_is_fifo_and_priority_stays_strict() -> None:
    joins: dict[str, list[str]] = {}
    for order in ("fifo", "drr"):
        s = sched(packs=True, tokens=4 * T512, max_size=3, order=order)
        for i in range(5):
            s.add(req(f"s{i}", 0.01 * i, 512, steps=1 + i % 2))
        joins[order] = [e.request.request_id for t in range(6) for e in _joined_and_stepped(s, float(t))]
    assert joins["drr"] == joins["fifo"]
    s = sched(packs=True, tokens=4 * T512, order="drr")
    s.add(req("a", 0.0, 512, steps=3))
    s.step_done(step(s.schedule(0.0)))
    s.add(req("low-small", 0.1, 256, priority=1))
    s.add(req("high-big", 0.2, 1024, priority=0))  # does not fit beside a: the lower priority does not pass it
    assert step(s.schedule(0.3)).joined == []


def _joined_and_stepped(s: StepScheduler, now: float) -> list:
    decision = s.schedule(now)
    if isinstance(decision, Idle):
        return []
    plan = step(decision)
    s.step_done(plan)
    return plan.joined


def test_continuous_drr_hands_a_request_that_cannot_step_to_the_request_level_rules_on_its_turn() -> None:
    s = sched(packs=True, tokens=4 * T512, order="drr")
    s.add(req("L", 0.0, 1024))
    s.add(req("edit", 0.1, 512, ineligible_reason="image_conditioning"))
    batch = dispatched(s.schedule(0.2))  # fifo would start L's group: the edit's class is the cheaper one
    assert batch.request_ids == ["edit"]
    s.complete(batch)
    assert [e.request.request_id for e in step(s.schedule(0.3)).rows] == ["L"]


def test_the_default_budget_is_the_row_cap_at_the_largest_size_capped_by_memory() -> None:
    auto = resolve_token_budget(None, 8, size=(1024, 1024), one_row=4096)
    assert auto.tokens == 8 * 4096 and "--batching-max-size 8" in auto.source
    capped = resolve_token_budget(None, 8, size=(1024, 1024), one_row=4096, memory_bytes=10_000, bytes_per_token=1)
    assert capped.tokens == 10_000 and "activation-memory" in capped.source
    floor = resolve_token_budget(None, 8, size=(1024, 1024), one_row=4096, memory_bytes=100, bytes_per_token=1)
    assert floor.tokens == 4096  # never below one row of the largest size
    assert resolve_token_budget(5000, 8, size=(1024, 1024), one_row=4096).tokens == 5000
    assert largest_size(1536, 1024, [(512, 512)]) == (1536, 1024) and largest_size(None, None, [(512, 768)]) == (
        512,
        768,
    )


def test_a_budget_below_one_row_of_the_largest_size_names_both_flags_and_the_size() -> None:
    with pytest.raises(ConfigError) as refused:
        check_max_tokens(1000, 4, (1024, 1024), 4096)
    message = refused.value.message
    assert "--batching-max-tokens 1000" in message and "--batching-max-size 4" in message and "1024x1024" in message
    assert refused.value.param == "batching_max_tokens" and "at least 4096" in message
    check_max_tokens(4096, 4, (1024, 1024), 4096)


@pytest.mark.parametrize("value", [0, -5, True])
def test_config_validate_names_the_token_flag(value: object) -> None:
    with pytest.raises(ConfigError, match="--batching-max-tokens"):
        BatchingConfig(mode="dynamic", max_size=4, max_tokens=value).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--batching-order"):
        BatchingConfig(mode="dynamic", order="lifo").validate()


def test_the_engine_gives_a_default_budget_only_to_families_that_pack_mixed_sizes() -> None:
    from diffuserve.engine.token_costs import model_token_budget
    from diffuserve.family_spec.base import SamplingDefaults
    from diffuserve.sampling import ModelDescription

    config = BatchingConfig(mode="dynamic", max_size=8)
    model = ModelDescription(defaults=SamplingDefaults(width=1024, height=1024), size_multiple=16)
    budget, counter = model_token_budget(config, model, None)
    assert budget is None and counter(SamplingParams(width=512, height=768)) == 32 * 48  # rows only, as before
    packing = ModelDescription(defaults=model.defaults, size_multiple=16, packs_mixed_sizes=True, max_width=1536)
    budget, _ = model_token_budget(config, packing, None)
    assert budget is not None and budget.tokens == 8 * 4096  # no height limit: the default size is the largest
    explicit, _ = model_token_budget(BatchingConfig(mode="dynamic", max_size=8, max_tokens=5000), model, None)
    assert explicit is not None and explicit.tokens == 5000  # the flag applies to every family
    with pytest.raises(ConfigError, match="--batching-max-tokens 100 .* 1024x1024"):
        model_token_budget(BatchingConfig(mode="dynamic", max_size=8, max_tokens=100), model, None)


def test_strength_leaves_the_signature_only_for_families_that_take_it_per_row() -> None:
    """`FamilySpec.strength_per_row`: edits of different strengths join one batch; without it, or when the
    requests run a step cache, `strength` is compared as before (tests/integration/test_mixed_strengths.py checks
    each merged row against its solo run)."""
    from dataclasses import replace

    from diffuserve.config.step_cache import parse_step_cache

    def edit(rid: str, t: float, strength: float, **fields: object) -> Request:
        r = req(rid, t)
        return Request(
            request_id=rid,
            params=replace(r.params, strength=strength, **fields),  # type: ignore[arg-type]
            arrival_time=t,
            model=MODEL,
        )

    for per_row in (False, True):
        b = batcher()
        b.set_capabilities(supports_batching=True, strength_per_row=per_row)
        for rid, t, s in (("a", 0.0, 0.5), ("b", 0.1, 0.75), ("c", 0.2, 1.0)):
            b.add(edit(rid, t, s))
        ids = [r.request_id for r in dispatched(b.schedule(1.0)).requests]
        assert ids == (["a", "b", "c"] if per_row else ["a"])
    b = batcher()
    b.set_capabilities(supports_batching=True, strength_per_row=True)
    cache = parse_step_cache("fbcache")
    b.add(edit("a", 0.0, 0.5, step_cache=cache))
    b.add(edit("b", 0.1, 0.75, step_cache=cache))
    assert [r.request_id for r in dispatched(b.schedule(1.0)).requests] == ["a"]
