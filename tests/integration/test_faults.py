"""Failure isolation in an in-process engine with a failing pipeline stage (operator-only hook)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from diffuserve.engine.engine import AsyncEngine, EngineConfig
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
from diffuserve.errors import GenerationError
from diffuserve.executor.base import InProcessExecutor, ServingPipeline
from diffuserve.models.loader import load_pipeline
from diffuserve.pipelines.fault_hooks import inject_faults
from diffuserve.sampling import SamplingParams

MARKER = "BOOM"


@pytest.fixture(scope="module")
def pipeline(tiny_flux_path: Path):
    return inject_faults(ServingPipeline.of(load_pipeline(tiny_flux_path)), MARKER)


def _engine(pipeline, *, max_size: int, delay_ms: float) -> AsyncEngine:
    batcher = RequestLevelScheduler(
        BatchingConfig(mode="dynamic", max_size=max_size, delay_ms=delay_ms), model_names=["tiny"]
    )
    engine = AsyncEngine(
        InProcessExecutor(lambda: pipeline),
        batcher,
        config=EngineConfig(max_queue_size=0, enable_warmup=False),
        metrics=EngineMetrics(),
        model_name="tiny",
    )
    engine.start()
    assert engine.wait_ready(60)
    return engine


def _params(prompt: str, seed: int, steps: int = 1) -> SamplingParams:
    return SamplingParams(prompt=prompt, width=32, height=32, num_inference_steps=steps, seed=seed)


def test_exactly_the_failing_batch_gets_errors(pipeline):
    engine = _engine(pipeline, max_size=4, delay_ms=2000)

    async def scenario() -> list:
        doomed = [engine.generate(_params(f"{MARKER} {i}" if i == 2 else f"ok {i}", i, steps=1)) for i in range(4)]
        healthy = [engine.generate(_params(f"fine {i}", i, steps=2)) for i in range(4)]
        return await asyncio.gather(*doomed, *healthy, return_exceptions=True)

    try:
        results = asyncio.run(scenario())
    finally:
        engine.stop()
    doomed, healthy = results[:4], results[4:]
    assert all(isinstance(r, GenerationError) and "dynamic batch of 4 requests" in r.message for r in doomed)
    assert all(not isinstance(r, BaseException) and r.batch_size == 4 for r in healthy)


def test_server_survives_100_consecutive_failing_batches(pipeline):
    engine = _engine(pipeline, max_size=1, delay_ms=0)

    async def scenario() -> tuple[list, object]:
        failures = [
            await asyncio.gather(engine.generate(_params(f"{MARKER} {i}", i)), return_exceptions=True)
            for i in range(100)
        ]
        after = await engine.generate(_params("after the storm", 1))
        return failures, after

    try:
        failures, after = asyncio.run(scenario())
    finally:
        engine.stop()
    assert len(failures) == 100
    assert all(isinstance(f[0], GenerationError) and "injected fault" in f[0].message for f in failures)
    assert len(after.output.images) == 1
    assert engine.metrics.requests.labels(endpoint="images", status="error")._value.get() == 100


def test_an_internal_error_around_a_batch_does_not_kill_the_loop(pipeline):
    from diffuserve.engine.metrics import BatchingStats

    class FlakyStats(BatchingStats):
        """Raises on the first dispatch only: a bug outside the pipeline call."""

        calls = 0

        def record(self, batch) -> None:
            FlakyStats.calls += 1
            if FlakyStats.calls == 1:
                raise RuntimeError("stats bug")
            super().record(batch)

    engine = _engine(pipeline, max_size=1, delay_ms=0)
    engine.batching_stats = FlakyStats(engine.metrics, log_enabled=False)

    async def scenario() -> list:
        first = await asyncio.gather(engine.generate(_params("first", 1)), return_exceptions=True)
        second = await engine.generate(_params("second", 2))
        return [first[0], second]

    try:
        first, second = asyncio.run(scenario())
    finally:
        engine.stop()
    assert isinstance(first, GenerationError) and "stats bug" in first.message
    assert len(second.output.images) == 1


def test_fault_hook_is_transparent_for_every_family(tiny_checkpoint):
    """A served Wan model with fault hooks is still a video model with its own defaults and limits (only the
    calls are hooked)."""
    inner = load_pipeline(tiny_checkpoint("wan"))
    wrapped = inject_faults(ServingPipeline.of(inner), MARKER)
    assert wrapped.output_kind == "video" and wrapped.family == inner.family == "wan"
    assert wrapped.defaults == inner.defaults and wrapped.describe_model().output_kind == "video"
    model = wrapped.describe_model()
    assert (model.size_multiple, model.frame_multiple, wrapped.describe()["max_size"][0]) == (
        inner.size_multiple,
        inner.frame_multiple,
        inner.max_width,
    )
    params = SamplingParams(prompt=f"a {MARKER}", width=32, height=32, num_frames=5, num_inference_steps=1, seed=0)
    with pytest.raises(Exception, match="injected fault"):
        wrapped.run([params])
