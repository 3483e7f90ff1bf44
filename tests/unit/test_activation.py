"""Activation memory (`diffuserve/activation.py`): the estimate, the 400 naming the field with the largest value that
fits, the budget, and admission (scheduler rule 9, step scheduler rule 6, the engine) — pure, fake clock, gated on
observed state."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from diffuserve.activation import (
    GIB,
    REQUEST_FLOOR,
    ActivationFacts,
    activation_budget,
    activation_facts,
    check_fits,
    estimate_bytes,
    weights_on_device,
)
from diffuserve.config.model_profiles import ComponentProfile, ModelProfile
from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.engine.engine import AsyncEngine, EngineConfig
from diffuserve.engine.request import Request
from diffuserve.engine.scheduler import ACTIVATION_MEMORY, BatchingConfig, Dispatch, Idle, RequestLevelScheduler
from diffuserve.engine.step_scheduler import StepPlan, StepScheduler
from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.unit.test_engine import WAIT_S, CountingMetrics, FakeExecutor, _answers, _params, until_async

FLUX = ActivationFacts(kind="image", token_side=16, hidden_size=3072, vae_channels=512, dtype_bytes=2)
WAN = ActivationFacts(kind="video", token_side=16, hidden_size=1536, vae_channels=384, dtype_bytes=2)
MESH = ActivationFacts(kind="mesh", chunk_size=32000, decoder_width=1024, max_octree_resolution=512)


def image(width: int = 1024, height: int = 1024, **extra) -> SamplingParams:
    return SamplingParams(prompt="p", width=width, height=height, **extra)


# -- the estimate ---------------------------------------------------------------------------------------------
def test_the_estimate_grows_with_every_field_that_makes_work_bigger():
    base = estimate_bytes(FLUX, image())
    assert estimate_bytes(FLUX, image(2048, 2048)) > 3 * base
    assert estimate_bytes(FLUX, image(n=4)) == 4 * (base - REQUEST_FLOOR) + REQUEST_FLOOR
    assert estimate_bytes(FLUX, image(image_inputs=(b"x",))) > base  # an edit's input image is tokens too
    video = SamplingParams(prompt="p", width=832, height=480, num_frames=81)
    assert estimate_bytes(WAN, video) > 2 * estimate_bytes(WAN, dataclasses.replace(video, num_frames=33))
    mesh = SamplingParams(octree_resolution=512)
    smaller = estimate_bytes(MESH, dataclasses.replace(mesh, octree_resolution=256))
    assert estimate_bytes(MESH, mesh) - smaller >= (513**3 - 257**3) * 4
    # A mesh's grid is the floor: one float32 per point at least.
    assert estimate_bytes(MESH, mesh) > 513**3 * 4


def test_facts_come_from_the_checkpoint_configs_with_flux_sized_fallbacks():
    configs = {
        "transformer": {"num_attention_heads": 24, "attention_head_dim": 128},
        "vae": {"block_out_channels": [128, 256, 512, 512]},
    }
    facts = activation_facts("image", configs, size_multiple=16, dtype_bytes=2)
    assert (facts.hidden_size, facts.vae_channels, facts.token_side, facts.dtype_bytes) == (3072, 512, 16, 2)
    wan = activation_facts(
        "video",
        {"transformer": {"hidden_size": 1536}, "vae": {"base_dim": 96, "dim_mult": [1, 2, 4, 4]}},
        size_multiple=16,
        dtype_bytes=2,
    )
    assert (wan.hidden_size, wan.vae_channels) == (1536, 384)
    unknown = activation_facts("image", {}, size_multiple=None, dtype_bytes=4)
    assert (unknown.hidden_size, unknown.vae_channels, unknown.token_side) == (3072, 512, 16)


# -- the 400: the field and the largest value that fits --------------------------------------------------------
def test_a_size_too_big_names_size_and_the_largest_square_that_fits():
    budget = estimate_bytes(FLUX, image(1024, 1024)) + 1
    assert check_fits(FLUX, image(1024, 1024), budget) == budget - 1
    with pytest.raises(InvalidRequestError) as info:
        check_fits(FLUX, image(4096, 4096), budget)
    assert info.value.param == "size"
    assert "size 4096x4096 needs ~" in info.value.message and "largest square size that fits is 1024x1024" in (
        info.value.message
    )
    # The largest square that fits is exact: the next multiple does not fit.
    assert estimate_bytes(FLUX, image(1040, 1040)) > budget


def test_n_is_named_when_one_row_fits():
    budget = estimate_bytes(FLUX, image(n=3)) + 1
    with pytest.raises(InvalidRequestError) as info:
        check_fits(FLUX, image(n=8), budget)
    assert info.value.param == "n" and "the largest n that fits is 3" in info.value.message


def test_video_names_num_frames_when_the_fewest_frames_fit_else_size():
    video = SamplingParams(prompt="p", width=832, height=480, num_frames=81)
    budget = estimate_bytes(WAN, dataclasses.replace(video, num_frames=33)) + 1
    with pytest.raises(InvalidRequestError) as info:
        check_fits(WAN, video, budget)
    assert info.value.param == "num_frames" and "the most frames that fit at this size are 33" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        check_fits(WAN, dataclasses.replace(video, width=4096, height=4096), budget)
    assert info.value.param == "size"


def test_meshes_name_octree_resolution_and_the_largest_that_fits():
    budget = estimate_bytes(MESH, SamplingParams(octree_resolution=256)) + 1
    with pytest.raises(InvalidRequestError) as info:
        check_fits(MESH, SamplingParams(octree_resolution=512), budget)
    assert info.value.param == "octree_resolution"
    assert "octree_resolution=512 needs ~" in info.value.message
    assert "the largest octree_resolution that fits is 256" in info.value.message


# -- the budget -----------------------------------------------------------------------------------------------
def test_the_budget_is_the_flag_else_the_free_memory_after_the_weights_times_a_fraction():
    assert activation_budget(override_gib=8, device_kind="cuda", free_bytes=0, weights_on_device=0).bytes == 8 * GIB
    unbounded = activation_budget(override_gib=0, device_kind="cuda", free_bytes=80 * GIB, weights_on_device=0)
    assert unbounded.bytes is None and "unbounded" in unbounded.describe()
    cuda = activation_budget(override_gib=None, device_kind="cuda", free_bytes=80 * GIB, weights_on_device=30 * GIB)
    assert cuda.bytes == int(50 * GIB * 0.9) and "after 30.00 GiB of weights" in cuda.source
    cpu = activation_budget(override_gib=None, device_kind="cpu", free_bytes=20 * GIB, weights_on_device=4 * GIB)
    assert cpu.bytes == int(16 * GIB * 0.75)
    full = activation_budget(override_gib=None, device_kind="cuda", free_bytes=10 * GIB, weights_on_device=30 * GIB)
    assert full.bytes == 0


def test_weights_on_device_follow_the_plans_modes_and_the_profiles_bytes():
    components = {
        "transformer": ComponentProfile(name="transformer", group="dit", param_bytes=24 * GIB, num_layers=24),
        "text_encoder": ComponentProfile(name="text_encoder", group="text_encoder", param_bytes=9 * GIB),
        "vae": ComponentProfile(name="vae", group="vae", param_bytes=1 * GIB),
    }
    profile = ModelProfile(components=components)
    plan = DeploymentPlan(
        components={
            "transformer": ComponentPlan("transformer", "dit", ResidencyMode.RESIDENT),
            "text_encoder": ComponentPlan("text_encoder", "text_encoder", ResidencyMode.COMPONENT_OFFLOAD),
            "vae": ComponentPlan("vae", "vae", ResidencyMode.RESIDENT),
        }
    )
    assert weights_on_device(plan, profile, "cuda") == 25 * GIB + 9 * GIB  # resident + the largest moved on
    plan.components["transformer"].mode = ResidencyMode.LAYERWISE_OFFLOAD
    plan.components["transformer"].prefetch_size = 1
    assert weights_on_device(plan, profile, "cuda") == 1 * GIB + 9 * GIB  # 2 streamed layers < the encoder
    assert weights_on_device(plan, profile, "cpu") == 34 * GIB  # the host is the device


# -- admission: scheduler rule 9, step scheduler rule 6 -------------------------------------------------------
def _req(rid: str, t: float, nbytes: int) -> Request:
    return Request(request_id=rid, params=image(64, 64), arrival_time=t, model="m", activation_bytes=nbytes)


def test_a_head_waits_while_the_running_batch_holds_the_budget_and_starts_after():
    sched = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=4, delay_ms=0), model_names=["m"], slots=2)
    sched.activation_budget = 5  # per replica: 10 over the 2 slots
    sched.add(_req("a", 0.0, 7))
    first = sched.schedule(0.0)
    assert isinstance(first, Dispatch) and first.batch.request_ids == ["a"]
    sched.add(_req("b", 1.0, 4))
    assert sched.schedule(1.0) == Idle(busy=True)  # a free slot, but 7 + 4 > 10
    sched.note_answering(first.batch)
    sched.complete(first.batch)
    assert sched.schedule(1.0) == Idle(busy=True)  # still decoding: its memory is in use
    sched.note_answered(first.batch, 2.0)
    second = sched.schedule(2.0)
    assert isinstance(second, Dispatch) and second.batch.request_ids == ["b"]


def test_a_candidate_that_does_not_fit_beside_the_head_waits_for_the_next_batch():
    sched = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=4, delay_ms=0), model_names=["m"])
    sched.activation_budget = 10
    for rid, nbytes in (("a", 6), ("b", 5), ("c", 4)):
        sched.add(_req(rid, 0.0, nbytes))
    batch = sched.schedule(0.0)
    assert isinstance(batch, Dispatch)
    assert batch.batch.request_ids == ["a", "c"] and batch.batch.rejects == {ACTIVATION_MEMORY: 1}


def test_a_head_over_the_budget_still_starts_when_nothing_runs():
    sched = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=4, delay_ms=0), model_names=["m"])
    sched.activation_budget = 10
    sched.add(_req("a", 0.0, 50))  # the engine refuses such a request; if the budget shrank, it never starves
    assert isinstance(sched.schedule(0.0), Dispatch)


def test_a_continuous_joiner_waits_until_the_groups_estimate_leaves_room():
    sched = StepScheduler(BatchingConfig(mode="continuous", max_size=4, delay_ms=0), model_names=["m"])
    sched.activation_budget = 10
    sched.add(_req("a", 0.0, 6))
    plan = sched.schedule(0.0)
    assert isinstance(plan, StepPlan) and [e.request.request_id for e in plan.rows] == ["a"]
    sched.add(_req("b", 1.0, 6))
    sched.add(_req("c", 1.0, 1))  # fits, but strict order: it waits behind b
    sched.step_done(plan)
    plan = sched.schedule(1.0)
    assert isinstance(plan, StepPlan) and [e.request.request_id for e in plan.rows] == ["a"] and not plan.joined
    for entry in plan.rows:
        entry.step_index = entry.num_steps - 1
    sched.step_done(plan)  # a leaves
    plan = sched.schedule(2.0)
    assert isinstance(plan, StepPlan) and [e.request.request_id for e in plan.rows] == ["b", "c"]


# -- the engine: 400 before queueing, a second job waits while the first holds the budget ---------------------
@pytest.fixture
def engines():
    """Engines a test made: their pipelines are opened and the engines stopped, whatever the test did."""
    made: list[tuple[AsyncEngine, FakeExecutor]] = []
    yield made
    for engine, executor in made:
        executor.pipeline.open()
        engine.stop()


def _engine(executor: FakeExecutor, budget: int, mode: str) -> AsyncEngine:
    config = BatchingConfig(mode=mode, max_size=4, delay_ms=0)
    scheduler = (
        StepScheduler(config, model_names=["fake"])
        if mode == "continuous"
        else RequestLevelScheduler(config, model_names=["fake"])
    )
    engine = AsyncEngine(
        executor,
        scheduler,
        config=EngineConfig(max_queue_size=0, enable_warmup=False, activation_budget_bytes=budget),
        metrics=CountingMetrics(),
        model_name="fake",
    )
    engine.start()
    assert engine.wait_ready(WAIT_S)
    return engine


def test_the_engine_refuses_a_request_over_the_budget_before_queueing_it(engines):
    executor = FakeExecutor()
    facts = executor.pipeline.describe_model().activation
    assert facts is not None
    engine = _engine(executor, estimate_bytes(facts, _params("a")) + 1, "dynamic")
    engines.append((engine, executor))

    async def scenario() -> None:
        with pytest.raises(InvalidRequestError) as info:
            engine.submit(dataclasses.replace(_params("big"), width=4096, height=4096))
        assert info.value.param == "size" and "largest square size that fits is 32x32" in info.value.message
        assert engine.num_pending == 0 and engine.scheduler.num_queued == 0

    asyncio.run(scenario())


def test_a_second_continuous_request_waits_while_the_first_holds_the_budget(engines):
    executor = FakeExecutor()
    facts = executor.pipeline.describe_model().activation
    assert facts is not None
    one = estimate_bytes(facts, _params("a"))
    engine = _engine(executor, one + one // 2, "continuous")  # one request fits, two do not
    engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list:
        a = asyncio.ensure_future(engine.generate(_params("a"), request_id="a"))
        await until_async(lambda: pipeline.step_rows, "a's first step")
        b = asyncio.ensure_future(engine.generate(_params("b"), request_id="b"))
        await until_async(lambda: engine.num_pending == 2, "b to be admitted")
        pipeline.allow(1)  # a's second (last) step: b must not join it
        await until_async(lambda: len(pipeline.step_rows) == 2, "a's second step")
        assert engine.scheduler.num_queued == 1
        pipeline.open()
        return list(await asyncio.gather(a, b))

    a, b = asyncio.run(scenario())
    assert pipeline.step_rows == [["a"], ["a"], ["b"], ["b"]]
    assert a.output.images == ["a#final"] and b.output.images == ["b#final"]
    assert _answers(engine) == {"success": 2}
