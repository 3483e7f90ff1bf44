"""Mixed sizes through the real engine on the simulated accelerator (issue 31): a family that packs mixed sizes gets
one call for rows of different sizes (dynamic) and a running group that a request of another size joins at a step
boundary (continuous); `timings` report the call's rows and tokens, `/metrics` the packed calls and their padding
(parsed with prometheus_client), and the dispatch line says it."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffuserve.engine.engine import AsyncEngine, EngineConfig
from diffuserve.engine.metrics import BatchingStats, EngineMetrics
from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
from diffuserve.engine.step_scheduler import StepScheduler
from diffuserve.sampling import SamplingParams
from tests.conftest import log_messages
from tests.unit.test_engine import WAIT_S, FakeExecutor

SIZES = ((64, 64), (128, 64), (64, 128))
"""16, 32 and 32 latent tokens at the simulated 16-pixel token side."""


def _params(i: int, size: tuple[int, int], steps: int = 2) -> SamplingParams:
    return SamplingParams(prompt=f"p{i}", width=size[0], height=size[1], num_inference_steps=steps, seed=i)


def _engine(executor: FakeExecutor, *, mode: str, packs: bool, max_size: int, delay_ms: float) -> AsyncEngine:
    for pipeline in executor.pipelines:
        pipeline.packs_mixed_sizes = packs  # what FamilySpec.packs_mixed_sizes gives a native family
    config = BatchingConfig(mode=mode, max_size=max_size, delay_ms=delay_ms, max_tokens=4096)
    names = ["fake"]
    scheduler = (
        StepScheduler(config, model_names=names)
        if mode == "continuous"
        else RequestLevelScheduler(config, model_names=names)
    )
    metrics = EngineMetrics()
    engine = AsyncEngine(
        executor,
        scheduler,
        config=EngineConfig(max_queue_size=0, request_timeout_s=0.0, enable_warmup=False),
        metrics=metrics,
        batching_stats=BatchingStats(metrics, log_enabled=True),
        model_name="fake",
    )
    engine.start()
    assert engine.wait_ready(WAIT_S)
    return engine


def _samples(engine: AsyncEngine) -> dict[tuple[str, tuple], float]:
    text = engine.metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_rows_of_different_sizes_share_one_call_and_timings_and_metrics_say_so(caplog) -> None:
    executor = FakeExecutor()
    executor.pipeline.open()
    engine = _engine(executor, mode="dynamic", packs=True, max_size=3, delay_ms=60_000.0)  # full at 3 rows
    try:
        with caplog.at_level(logging.INFO, logger="diffuserve.batching"):

            async def run() -> list:
                return list(await asyncio.gather(*(engine.generate(_params(i, s)) for i, s in enumerate(SIZES))))

            results = asyncio.run(run())
        assert [prompts for _, prompts in executor.batches] == [["p0", "p1", "p2"]]
        assert {(r.batch_rows, r.batch_tokens) for r in results} == {(3, 16 + 32 + 32)}
        samples = _samples(engine)
        assert samples[("diffuserve_packed_calls_total", (("mode", "dynamic"),))] == 1
        assert samples[("diffuserve_batch_padding_tokens_total", (("mode", "dynamic"),))] == 3 * 32 - 80
        assert samples[("diffuserve_batch_tokens_sum", (("mode", "dynamic"),))] == 80
        assert samples[("diffuserve_token_budget", ())] == 4096
        line = next(m for m in log_messages(caplog) if m.startswith("Dynamic batch dispatch"))
        assert "stop_reason=max_size, tokens=80/4096, packed_sizes=3, padding_tokens=16" in line
    finally:
        engine.stop()


@pytest.mark.parametrize("packs", [True, False])
def test_a_request_of_another_size_joins_a_running_group_only_when_the_family_packs(packs: bool) -> None:
    executor = FakeExecutor()
    pipeline = executor.pipeline
    engine = _engine(executor, mode="continuous", packs=packs, max_size=4, delay_ms=0.0)
    try:

        async def run() -> list:
            first = asyncio.ensure_future(engine.generate(_params(0, SIZES[0], steps=3)))
            await asyncio.to_thread(pipeline.allow, 1)
            await asyncio.to_thread(pipeline.wait_steps, 1)  # p0 is running: a step boundary is next
            second = asyncio.ensure_future(engine.generate(_params(1, SIZES[1], steps=2)))
            await asyncio.to_thread(lambda: _wait_queued(engine))
            pipeline.open()
            return list(await asyncio.gather(first, second))

        results = asyncio.run(run())
        shared = [rows for rows in pipeline.step_rows if rows == ["p0", "p1"]]
        assert bool(shared) is packs
        assert [r.output.images for r in results] == [["p0#final"], ["p1#final"]]  # each its own rows, as alone
        packed = _samples(engine).get(("diffuserve_packed_calls_total", (("mode", "continuous"),)), 0)
        assert (packed >= 1) is packs  # the steps that held both sizes are packed calls
        if packs:
            assert max(r.batch_tokens for r in results) == 16 + 32
    finally:
        pipeline.open()
        engine.stop()


def _wait_queued(engine: AsyncEngine) -> None:
    from tests.unit.test_engine import until

    until(lambda: engine.scheduler.num_queued == 1 or len(engine.scheduler.group) == 2, "the second request queued")
