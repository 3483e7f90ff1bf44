"""The engine's invariants, driven through a fake executor whose work is gated on events (no model, no sleeps).

Every accepted request is answered exactly once (success, error, timeout, cancel, client disconnect, shutdown,
rank fault); deadlines remove a request at a step boundary; a queued request is aborted before it runs and a
running one stops at the next step; a deferred decode answers from the decode lane while the next batch runs;
data-parallel batches go to the free replica with the fewest rows; continuous requests join, leave and finish
at step boundaries.

The fake pipeline's denoising steps each wait for a permit the test grants (`FakePipeline.allow`), so the test
decides where every batch stands; it waits on observed state (steps run, calls made), never on time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from diffuserve.engine.engine import AsyncEngine, EngineConfig, EngineState
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.engine.offline import OfflineEngine
from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
from diffuserve.engine.step_scheduler import StepScheduler
from diffuserve.errors import (
    GenerationError,
    RequestCancelledError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from diffuserve.executor.messages import PreviewSink
from diffuserve.sampling import SamplingParams
from diffuserve.tools.sim_executor import SimulatedExecutor, SimulatedPipeline

WAIT_S = 20.0
"""Upper bound of every wait on observed state (a generous cap for a loaded machine; never a timing gate)."""


def until(check: Callable[[], bool], what: str) -> None:
    """Poll observed state until `check()` holds (from a thread)."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


async def until_async(check: Callable[[], bool], what: str) -> None:
    """Poll observed state until `check()` holds (from the event loop)."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


class FakeClock:
    """The engine's clock, moved by the test (deadlines); starts at 1000."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePipeline(SimulatedPipeline):
    """The simulated pipeline (`tools/sim_executor.py`) whose every denoising step waits for a permit the test
    grants."""

    def __init__(self, *, defers_decode: bool = False):
        super().__init__(defers_decode=defers_decode)
        self.free = False
        """True: steps run without permits."""
        self._permits = threading.Semaphore(0)

    # -- test controls ----------------------------------------------------------------------------------
    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        self.free = True
        self._permits.release(1000)

    def wait_steps(self, n: int) -> None:
        until(lambda: self.steps_run >= n, f"{n} denoising steps")

    def wait_turn(self, prompts: Sequence[str], rows: int) -> None:
        while not self.free and not self._permits.acquire(timeout=0.05):
            pass


class FakeExecutor(SimulatedExecutor):
    """`replicas` fake pipelines, each run by the in-process executor of its own replica; records every batch."""

    pipelines: list[FakePipeline]  # type: ignore[assignment]

    def __init__(self, replicas: int = 1, *, defers_decode: bool = False, clock: Callable[[], float] | None = None):
        super().__init__(replicas, make_pipeline=lambda: FakePipeline(defers_decode=defers_decode), clock=clock)

    @property
    def pipeline(self) -> FakePipeline:
        return self.pipelines[0]


class CountingMetrics(EngineMetrics):
    """Counts every answer by status, so a request answered twice shows up."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: Counter[str] = Counter()

    def observe_request(self, endpoint: str, status: str, latency_s: float | None = None) -> None:
        self.answers[status] += 1
        super().observe_request(endpoint, status, latency_s)


def _params(prompt: str, *, steps: int = 2, n: int = 1, seed: int = 0) -> SamplingParams:
    return SamplingParams(prompt=prompt, width=32, height=32, num_inference_steps=steps, seed=seed, n=n)


def _engine(
    executor: FakeExecutor,
    *,
    mode: str = "dynamic",
    max_size: int = 4,
    delay_ms: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    timeout_s: float = 0.0,
) -> AsyncEngine:
    config = BatchingConfig(mode=mode, max_size=max_size, delay_ms=delay_ms)
    scheduler: RequestLevelScheduler
    if mode == "continuous":
        scheduler = StepScheduler(config, model_names=["fake"])
    else:
        scheduler = RequestLevelScheduler(config, model_names=["fake"], slots=len(executor.replicas))
    engine = AsyncEngine(
        executor,
        scheduler,
        config=EngineConfig(max_queue_size=0, request_timeout_s=timeout_s, enable_warmup=False),
        metrics=CountingMetrics(),
        model_name="fake",
        clock=clock,
    )
    engine.start()
    assert engine.wait_ready(WAIT_S)
    return engine


@pytest.fixture
def stop_engines():
    """Engines a test made: their pipelines are opened and the engines stopped, whatever the test did."""
    made: list[tuple[AsyncEngine, FakeExecutor]] = []
    yield made
    for engine, executor in made:
        for pipeline in executor.pipelines:
            pipeline.open()
            pipeline.decode_gate.set()
        engine.stop()


def _answers(engine: AsyncEngine) -> Counter[str]:
    return engine.metrics.answers  # type: ignore[attr-defined]


async def _settle(tasks: Sequence[asyncio.Future[Any]]) -> list[Any]:
    return list(await asyncio.gather(*tasks, return_exceptions=True))


# -- request-level batching ---------------------------------------------------------------------------------
def test_success_merges_a_batch_and_answers_each_request_once(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, max_size=4, delay_ms=60_000)
    stop_engines.append((engine, executor))

    async def scenario() -> list[Any]:
        tasks = [asyncio.ensure_future(engine.generate(_params(f"p{i}", seed=i))) for i in range(4)]
        executor.pipeline.open()
        return await _settle(tasks)

    results = asyncio.run(scenario())
    assert [r.output.images for r in results] == [[f"p{i}#0"] for i in range(4)]
    assert all(r.batch_size == 4 and r.batch_rows == 4 for r in results)
    assert executor.batches == [(0, ["p0", "p1", "p2", "p3"])]
    assert _answers(engine) == {"success": 4}
    assert engine.num_pending == 0


def test_a_failing_batch_errors_exactly_its_requests_and_the_loop_serves_on(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, max_size=2, delay_ms=60_000)
    stop_engines.append((engine, executor))
    executor.pipeline.open()

    async def scenario() -> list[Any]:
        doomed = [asyncio.ensure_future(engine.generate(_params(p))) for p in ("FAIL a", "b")]
        first = await _settle(doomed)
        healthy = [asyncio.ensure_future(engine.generate(_params(p))) for p in ("c", "d")]
        return first + await _settle(healthy)

    results = asyncio.run(scenario())
    assert all(isinstance(r, GenerationError) and "dynamic batch of 2 requests" in r.message for r in results[:2])
    assert [r.output.images for r in results[2:]] == [["c#0"], ["d#0"]]
    assert _answers(engine) == {"error": 2, "success": 2}


def test_deadline_answers_504_at_a_step_boundary_and_the_batch_goes_on(stop_engines):
    clock = FakeClock()
    executor = FakeExecutor(clock=clock)
    engine = _engine(executor, max_size=2, delay_ms=60_000, clock=clock)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        late = asyncio.ensure_future(engine.generate(_params("late", steps=3), timeout_s=10, request_id="late"))
        other = asyncio.ensure_future(engine.generate(_params("other", steps=3), request_id="other"))
        await until_async(lambda: pipeline.calls, "the batch to start")
        pipeline.allow(1)
        await until_async(lambda: engine.progress("late") == (1, 3), "step 1 of the batch")
        clock.now += 11  # past the deadline of `late`: the next boundary answers it
        pipeline.allow(1)
        await until_async(late.done, "the deadline answer")
        assert engine.progress("other") == (2, 3)
        pipeline.open()
        return await _settle([late, other])

    late, other = asyncio.run(scenario())
    assert isinstance(late, RequestTimeoutError) and "step 2/3" in late.message
    assert other.output.images == ["other#0"]
    assert _answers(engine) == {"timeout": 1, "success": 1}


def test_a_queued_request_past_its_deadline_is_answered_504_without_running(stop_engines):
    clock = FakeClock()
    executor = FakeExecutor(clock=clock)
    engine = _engine(executor, max_size=4, delay_ms=60_000, clock=clock)
    stop_engines.append((engine, executor))

    async def scenario() -> Any:
        task = asyncio.ensure_future(engine.generate(_params("queued"), timeout_s=5))
        await until_async(lambda: engine.scheduler.num_queued == 1, "the request to queue")
        clock.now += 6
        engine.book.wake()  # wake the idle loop at once rather than at its next idle check
        return (await _settle([task]))[0]

    result = asyncio.run(scenario())
    assert isinstance(result, RequestTimeoutError) and "waited in the queue" in result.message
    assert executor.batches == []
    assert _answers(engine) == {"timeout": 1}


def test_abort_of_a_queued_request_never_runs_it(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="singleton", max_size=1)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        running = asyncio.ensure_future(engine.generate(_params("running")))
        await until_async(lambda: pipeline.calls, "the first batch to start")
        queued = asyncio.ensure_future(engine.generate(_params("queued")))
        await until_async(lambda: engine.scheduler.num_queued == 1, "the second request to queue")
        queued.cancel()  # the client went away
        await until_async(lambda: engine.scheduler.num_queued == 0, "the abort")
        pipeline.open()
        return await _settle([running, queued])

    running, queued = asyncio.run(scenario())
    assert running.output.images == ["running#0"]
    assert isinstance(queued, asyncio.CancelledError)
    assert executor.batches == [(0, ["running"])]
    assert _answers(engine) == {"success": 1, "cancelled": 1}


def test_abort_of_a_running_request_stops_its_batch_at_the_next_step(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="singleton", max_size=1)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        task = asyncio.ensure_future(engine.generate(_params("doomed", steps=50)))
        await until_async(lambda: pipeline.calls, "the batch to start")
        pipeline.allow(1)
        await until_async(lambda: pipeline.steps_run == 1, "one step")
        task.cancel()
        await until_async(lambda: engine.num_pending == 0, "the cancel answer")
        pipeline.allow(1)  # the step in flight ends; the loop sees the cancel and stops
        after = asyncio.ensure_future(engine.generate(_params("after")))
        await until_async(lambda: len(pipeline.calls) == 2, "the next batch")
        pipeline.open()
        return await _settle([task, after])

    doomed, after = asyncio.run(scenario())
    assert isinstance(doomed, asyncio.CancelledError)
    assert after.output.images == ["after#0"]
    assert pipeline.steps_run < 50 + 1
    assert _answers(engine) == {"cancelled": 1, "success": 1}
    # /metrics tells the stop and its step (as the line "stopped at step k/50"): the doomed batch's steps only.
    sample = engine.metrics.registry.get_sample_value
    assert sample("diffuserve_stopped_batch_steps_count") == 1
    assert sample("diffuserve_stopped_batch_steps_sum") == pipeline.steps_run - 2  # "after" ran 2 steps


def test_abort_with_an_error_answers_that_error_once(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="singleton", max_size=1)
    stop_engines.append((engine, executor))

    async def scenario() -> Any:
        future = engine.submit(_params("job"), request_id="job-1")
        await until_async(lambda: executor.pipeline.calls, "the batch to start")
        engine.abort("job-1", RequestCancelledError("cancelled by the job API"))
        engine.abort("job-1")  # a second abort of an answered request does nothing
        executor.pipeline.open()
        return (await _settle([future]))[0]

    result = asyncio.run(scenario())
    assert isinstance(result, RequestCancelledError) and result.message == "cancelled by the job API"
    assert _answers(engine) == {"cancelled": 1}


def test_shutdown_answers_queued_and_running_requests_503_once(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="singleton", max_size=1)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> tuple[list[Any], int]:
        tasks = [asyncio.ensure_future(engine.generate(_params(f"p{i}", steps=50))) for i in range(3)]
        await until_async(lambda: pipeline.calls and engine.scheduler.num_queued == 2, "one running, two queued")
        failed = await engine.drain(0.0)
        results = await _settle(tasks)
        with pytest.raises(ServiceUnavailableError):
            await engine.generate(_params("late"))
        pipeline.open()
        return results, failed

    results, failed = asyncio.run(scenario())
    assert failed == 3
    assert all(isinstance(r, ServiceUnavailableError) and "shut down" in r.message for r in results)
    assert engine.state == EngineState.DRAINING
    assert _answers(engine) == {"error": 3}


def test_rank_fault_answers_everything_and_turns_the_engine_failed(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="singleton", max_size=1)
    stop_engines.append((engine, executor))
    fatal: list[str] = []
    engine.on_fatal = fatal.append
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        tasks = [asyncio.ensure_future(engine.generate(_params(f"p{i}", steps=50))) for i in range(2)]
        await until_async(lambda: pipeline.calls and engine.scheduler.num_queued == 1, "one running, one queued")
        engine.fail_rank("rank 1 of 2 exited (signal 9)")
        engine.fail_rank("rank 1 of 2 exited (signal 9)")  # declared once
        results = await _settle(tasks)
        with pytest.raises(ServiceUnavailableError, match="out of service"):
            await engine.generate(_params("late"))
        return results

    results = asyncio.run(scenario())
    assert all(isinstance(r, GenerationError) and "rank 1 of 2 exited" in r.message for r in results)
    assert engine.state == EngineState.FAILED and fatal == ["rank 1 of 2 exited (signal 9)"]
    assert _answers(engine) == {"error": 2}


def test_deferred_decode_answers_from_the_lane_while_the_next_batch_runs(stop_engines):
    executor = FakeExecutor(defers_decode=True)
    engine = _engine(executor, max_size=1)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline
    pipeline.decode_gate.clear()  # the first batch's decode waits in the decode lane

    async def scenario() -> list[Any]:
        first = asyncio.ensure_future(engine.generate(_params("first")))
        second = asyncio.ensure_future(engine.generate(_params("second")))
        pipeline.open()
        await until_async(lambda: len(pipeline.calls) == 2, "the second batch to start")
        assert not first.done()  # denoised, decode held: not answered yet
        pipeline.decode_gate.set()
        return await _settle([first, second])

    first, second = asyncio.run(scenario())
    assert first.output.images == ["first#0"] and second.output.images == ["second#0"]
    assert pipeline.decodes == [["first"], ["second"]]
    assert _answers(engine) == {"success": 2}


def test_a_deferred_decode_of_a_cancelled_batch_answers_once(stop_engines):
    executor = FakeExecutor(defers_decode=True)
    engine = _engine(executor, max_size=1)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline
    pipeline.decode_gate.clear()

    async def scenario() -> list[Any]:
        task = asyncio.ensure_future(engine.generate(_params("gone", steps=1)))
        pipeline.open()
        await until_async(
            lambda: pipeline.steps_run == 1 and engine.executor.replicas[0].batches == 1, "the batch to be denoised"
        )
        task.cancel()
        await until_async(lambda: engine.num_pending == 0, "the cancel answer")
        pipeline.decode_gate.set()
        after = asyncio.ensure_future(engine.generate(_params("after", steps=1)))
        return await _settle([task, after])

    gone, after = asyncio.run(scenario())
    assert isinstance(gone, asyncio.CancelledError) and after.output.images == ["after#0"]
    assert _answers(engine) == {"cancelled": 1, "success": 1}


def test_replica_choice_free_replica_with_fewest_rows(stop_engines):
    executor = FakeExecutor(replicas=2)
    engine = _engine(executor, mode="singleton", max_size=1)
    stop_engines.append((engine, executor))
    first, second = executor.pipelines

    async def scenario() -> None:
        # Both free, no rows yet: the lowest index takes it.
        first.open()
        await engine.generate(_params("a", n=2))
        assert executor.batches[-1] == (0, ["a"])
        await until_async(lambda: executor.replicas[0].batches == 1, "replica 0 to be free again")
        # Replica 0 has 2 rows, replica 1 none: replica 1 takes it (and holds it).
        b = asyncio.ensure_future(engine.generate(_params("b")))
        await until_async(lambda: len(executor.batches) == 2, "b to start")
        assert executor.batches[-1] == (1, ["b"])
        # Replica 1 is busy: the only free one, replica 0, takes the next.
        await engine.generate(_params("c"))
        assert executor.batches[-1] == (0, ["c"])
        second.open()
        await b
        await until_async(lambda: sum(s.batches for s in executor.replicas) == 3, "every replica to be free")
        assert [(s.rows, s.batches) for s in executor.replicas] == [(3, 2), (1, 1)]

    asyncio.run(scenario())
    assert _answers(engine) == {"success": 3}


def test_warm_up_runs_one_generation_per_replica_before_ready_and_answers_nobody():
    executor = FakeExecutor(replicas=2)
    for pipeline in executor.pipelines:
        pipeline.open()
    scheduler = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=2), model_names=["fake"], slots=2)
    engine = AsyncEngine(
        executor,
        scheduler,
        config=EngineConfig(enable_warmup=True, warmup_steps=1),
        metrics=CountingMetrics(),
        model_name="fake",
    )
    engine.start()
    try:
        assert engine.wait_ready(WAIT_S)
        assert executor.batches == [(0, ["warm-up"]), (1, ["warm-up"])]
        assert [p.steps_run for p in executor.pipelines] == [1, 1]
        assert _answers(engine) == {} and engine.num_pending == 0
    finally:
        engine.stop()


# -- continuous batching -------------------------------------------------------------------------------------
def test_continuous_requests_join_step_together_and_finish_on_their_own_step(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="continuous", max_size=4)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        a = asyncio.ensure_future(engine.generate(_params("a", steps=3), request_id="a"))
        await until_async(lambda: pipeline.step_rows, "a's first step")
        b = asyncio.ensure_future(engine.generate(_params("b", steps=3), request_id="b"))
        await until_async(lambda: engine.num_pending == 2, "b to be admitted")
        pipeline.allow(1)
        await until_async(lambda: len(pipeline.step_rows) == 2, "the second step")
        pipeline.allow(10)
        return await _settle([a, b])

    a, b = asyncio.run(scenario())
    assert pipeline.step_rows == [["a"], ["a", "b"], ["a", "b"], ["b"]]
    assert a.output.images == ["a#final"] and b.output.images == ["b#final"]
    assert pipeline.decodes == [["a"], ["b"]]
    assert executor.runner is not None and sorted(executor.runner.dropped) == ["a", "b"]
    assert _answers(engine) == {"success": 2}


def test_continuous_cancel_and_deadline_remove_rows_at_a_boundary(stop_engines):
    clock = FakeClock()
    executor = FakeExecutor(clock=clock)
    engine = _engine(executor, mode="continuous", max_size=3, delay_ms=60_000, clock=clock)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        stays = asyncio.ensure_future(engine.generate(_params("stays", steps=4), request_id="stays"))
        leaves = asyncio.ensure_future(engine.generate(_params("leaves", steps=4), request_id="leaves"))
        late = asyncio.ensure_future(engine.generate(_params("late", steps=4), request_id="late", timeout_s=5))
        await until_async(lambda: pipeline.step_rows, "the first step")
        leaves.cancel()
        await until_async(lambda: engine.num_pending == 2, "the cancel answer")
        clock.now += 6
        pipeline.allow(1)
        await until_async(late.done, "the deadline removal")
        pipeline.allow(10)
        return await _settle([stays, leaves, late])

    stays, leaves, late = asyncio.run(scenario())
    assert stays.output.images == ["stays#final"]
    assert isinstance(leaves, asyncio.CancelledError)
    assert isinstance(late, RequestTimeoutError) and "removed from the denoise group" in late.message
    assert pipeline.step_rows[0] == ["stays", "leaves", "late"]
    assert all(rows == ["stays"] for rows in pipeline.step_rows[1:])
    assert executor.runner is not None and {"leaves", "late", "stays"} <= set(executor.runner.dropped)
    assert _answers(engine) == {"success": 1, "cancelled": 1, "timeout": 1}


def test_continuous_failed_step_and_failed_start_fail_only_their_rows(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="continuous", max_size=4)
    stop_engines.append((engine, executor))
    executor.pipeline.open()

    async def scenario() -> list[Any]:
        bad = await _settle(
            [asyncio.ensure_future(engine.generate(_params(p, steps=2))) for p in ("BADSTART x", "FAIL y")]
        )
        good = await _settle([asyncio.ensure_future(engine.generate(_params("z", steps=2)))])
        return bad + good

    badstart, failed, good = asyncio.run(scenario())
    assert isinstance(badstart, GenerationError) and "injected start failure" in badstart.message
    assert isinstance(failed, GenerationError) and "injected step failure" in failed.message
    assert good.output.images == ["z#final"]
    assert _answers(engine) == {"error": 2, "success": 1}


def test_continuous_shutdown_answers_the_group_and_the_queue_once(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="continuous", max_size=1)
    stop_engines.append((engine, executor))
    pipeline = executor.pipeline

    async def scenario() -> list[Any]:
        tasks = [asyncio.ensure_future(engine.generate(_params(f"p{i}", steps=50))) for i in range(2)]
        await until_async(lambda: pipeline.step_rows and engine.scheduler.num_queued == 1, "one running, one queued")
        await engine.drain(0.0)
        pipeline.allow(2)
        return await _settle(tasks)

    results = asyncio.run(scenario())
    assert all(isinstance(r, ServiceUnavailableError) for r in results)
    assert _answers(engine) == {"error": 2}


def test_continuous_head_that_cannot_step_runs_as_a_request_level_batch(stop_engines):
    executor = FakeExecutor()
    engine = _engine(executor, mode="continuous", max_size=4)
    stop_engines.append((engine, executor))
    executor.pipeline.open()

    async def scenario() -> Any:
        return await engine.generate(_params("edit"), ineligible_reason="image_conditioning")

    result = asyncio.run(scenario())
    assert result.output.images == ["edit#0"]
    assert executor.batches == [(0, ["edit"])] and executor.pipeline.step_rows == []
    assert _answers(engine) == {"success": 1}


# -- previews (streaming) -------------------------------------------------------------------------------------
def _sink(partial_images: int) -> tuple[PreviewSink, list[tuple[int, list[Any]]]]:
    got: list[tuple[int, list[Any]]] = []
    return PreviewSink(partial_images, lambda index, images: got.append((index, images))), got


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_previews_reach_their_sink_before_the_final_image(stop_engines, mode):
    executor = FakeExecutor()
    engine = _engine(executor, mode=mode, max_size=1)
    stop_engines.append((engine, executor))
    executor.pipeline.open()
    sink, got = _sink(2)

    async def scenario() -> Any:
        return await engine.generate(_params("streamed", steps=6), preview=sink)

    result = asyncio.run(scenario())
    assert len(got) == 2 and [index for index, _ in got] == [0, 1]
    assert all(len(images) == 1 for _, images in got)
    assert result.output.images in (["streamed#0"], ["streamed#final"])
    assert _answers(engine) == {"success": 1}


# -- the serving pipeline ---------------------------------------------------------------------------------------
def test_the_serving_pipeline_declares_what_its_adapter_can_do():
    from diffuserve.errors import ConfigError
    from diffuserve.executor.base import Capabilities, ServingPipeline

    deferring = ServingPipeline.of(FakePipeline(defers_decode=True))
    assert deferring.capabilities == Capabilities(batching=True, continuous=True, defers_decode=True)
    assert deferring.lanes is deferring.served.lanes()  # the pipeline's own lanes, made once
    inline = ServingPipeline.of(FakePipeline())
    assert inline.lanes is None and not inline.capabilities.defers_decode
    assert inline.prefetch_text(_params("x"), lambda steps: None) is False
    with pytest.raises(ConfigError, match="cannot split its CFG branches"):
        inline.served.use_cfg_parallel(object())  # not a native recipe loop


# -- the offline client (`generate`) -------------------------------------------------------------------------------
def _offline(executor: FakeExecutor) -> OfflineEngine:
    config = BatchingConfig(mode="dynamic", max_size=4, delay_ms=0.0)
    return OfflineEngine(
        AsyncEngine(
            executor,
            RequestLevelScheduler(config, model_names=["fake"]),
            config=EngineConfig(max_queue_size=0, enable_warmup=False),
            model_name="fake",
        )
    )


def test_the_offline_client_answers_every_prompt_and_admits_them_as_one_arrival():
    executor = FakeExecutor()
    executor.pipeline.open()
    offline = _offline(executor)
    try:
        assert offline.start().family == "simulated"
        submitted = offline.submit_all([_params(f"p{i}") for i in range(3)])
        outputs = [s.result.result(WAIT_S).output.images for s in submitted]
    finally:
        offline.close()
    assert outputs == [[f"p{i}#0"] for i in range(3)]
    assert executor.batches == [(0, ["p0", "p1", "p2"])]  # delay 0, yet one batch: they arrived together


def test_the_offline_client_raises_the_load_error_as_it_was_and_close_cancels_what_runs():
    class Broken(FakeExecutor):
        def load(self) -> Any:
            raise ValueError("no such checkpoint")

    offline = _offline(Broken())
    with pytest.raises(ValueError, match="no such checkpoint"):
        offline.start()
    offline.close()
    executor = FakeExecutor()
    offline = _offline(executor)
    offline.start()
    (running,) = offline.submit_all([_params("held", steps=3)])
    executor.pipeline.allow(1)
    until(lambda: offline.progress(running.request_id) == (1, 3), "the first step reported")
    # Once answered (cancelled), the held step may go on: the batch then stops at the next boundary.
    threading.Thread(target=lambda: (running.result.exception(WAIT_S), executor.pipeline.open())).start()
    offline.close()  # a Ctrl-C in `generate`: what runs is cancelled, the engine stops
    with pytest.raises(RequestCancelledError):
        running.result.result(WAIT_S)
    assert executor.pipeline.steps_run < 3


# -- shape ------------------------------------------------------------------------------------------------------
def _imports_of(module: str) -> set[str]:
    """Every diffuserve module `engine/<module>.py` imports, function-level imports included."""
    import ast
    from pathlib import Path

    import diffuserve.engine

    tree = ast.parse((Path(diffuserve.engine.__file__).parent / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diffuserve"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("diffuserve"))
    return found


def test_the_engine_core_imports_down_the_stack_only():
    core = ("engine", "request_book", "batch_loop", "step_loop", "scheduler", "step_scheduler", "request")
    for module in core:
        imports = _imports_of(module)
        assert not any(m.startswith("diffuserve.pipelines") for m in imports), (module, imports)
        assert not any(m.startswith(("diffuserve.server", "diffuserve.launch")) for m in imports), (module, imports)
    # The two loops know nothing of each other or of the facade; the book knows no loop.
    assert not _imports_of("batch_loop") & {"diffuserve.engine.step_loop", "diffuserve.engine.engine"}
    assert not _imports_of("step_loop") & {"diffuserve.engine.batch_loop", "diffuserve.engine.engine"}
    assert not _imports_of("request_book") & {
        "diffuserve.engine.batch_loop",
        "diffuserve.engine.step_loop",
        "diffuserve.engine.engine",
    }
