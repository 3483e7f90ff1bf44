"""The engine's answers about itself: one `EngineStatus` (engine/status.py) for /health, /server_info and the remote
status message; "requests using adapter X" as an engine query; the scheduler protocol both modes implement.

Driven through test_engine.py's fake executor, whose steps the test releases; waits are on observed state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any

import pytest

from diffuserve.engine.engine import AsyncEngine
from diffuserve.engine.scheduler import RequestLevelScheduler
from diffuserve.engine.scheduler_protocol import RequestScheduler
from diffuserve.engine.status import EngineState, EngineStatus
from diffuserve.engine.step_scheduler import StepScheduler
from diffuserve.launch import engine_messages as m
from diffuserve.server.engine_client import RemoteEngineClient
from tests.unit.test_engine import FakeExecutor, _engine, _params, _settle, until_async


@pytest.fixture
def engines():
    made: list[tuple[AsyncEngine, FakeExecutor]] = []
    yield made
    for engine, executor in made:
        for pipeline in executor.pipelines:
            pipeline.open()
        engine.stop()


@pytest.mark.parametrize("mode", ["singleton", "continuous"])
def test_status_counts_queued_and_running_requests_and_their_adapters(engines, mode):
    executor = FakeExecutor()
    engine = _engine(executor, mode=mode, max_size=1)
    engines.append((engine, executor))
    pipeline = executor.pipeline
    idle = engine.status()
    assert idle.ready and idle.num_pending == 0 and idle.num_queued == 0 and idle.adapters_in_use == ()
    assert idle.pipeline == pipeline.describe() and idle.defaults == pipeline.defaults
    assert [r.replica for r in idle.replicas] == [0]

    async def scenario() -> tuple[EngineStatus, list[str], list[Any]]:
        first = dataclasses.replace(_params("first"), lora=(("style", 1.0),))
        second = dataclasses.replace(_params("second"), lora=(("other", 0.5),), width=64)  # never joins `first`
        running = asyncio.ensure_future(engine.generate(first))
        await until_async(lambda: engine.requests_using_adapter("style") and not engine.status().num_queued, "a start")
        queued = asyncio.ensure_future(engine.generate(second))
        await until_async(lambda: engine.status().num_queued == 1, "the second request to queue")
        status = engine.status()
        using = engine.requests_using_adapter("style") + engine.requests_using_adapter("other")
        pipeline.open()
        return status, using, await _settle([running, queued])

    status, using, answers = asyncio.run(scenario())
    assert status.num_pending == 2 and status.num_queued == 1
    assert status.adapters_in_use == ("other", "style")
    assert len(using) == 2  # the running one (batch or group row) and the queued one
    assert all(a.output.images for a in answers)
    done = engine.status()
    assert done.num_pending == 0 and done.adapters_in_use == () and engine.requests_using_adapter("style") == []


def test_status_is_a_frozen_snapshot(engines):
    executor = FakeExecutor()
    engine = _engine(executor)
    engines.append((engine, executor))
    status = engine.status()
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.num_queued = 3  # type: ignore[misc]
    executor.replicas[0].batches += 1  # the snapshot holds copies of the replica states
    assert status.replicas[0].batches == executor.replicas[0].batches - 1
    engine.begin_drain()
    assert engine.status().draining and not status.draining


def test_metrics_mirror_the_status_snapshot():
    """/metrics' engine gauges (queue depth, drain, each replica) are read from the one `EngineStatus`."""
    from prometheus_client.parser import text_string_to_metric_families

    from diffuserve.engine.metrics import EngineMetrics
    from diffuserve.executor.base import ReplicaState

    replicas = (ReplicaState(0, (0,), busy=True, batches=4, rows=9), ReplicaState(1, (1,), failed="rank 1 died"))
    metrics = EngineMetrics()
    EngineStatus(EngineState.DRAINING, num_queued=3, replicas=replicas).mirror_into(metrics)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        for s in family.samples
    }
    assert samples[("diffuserve_queue_depth", ())] == 3 and samples[("diffuserve_draining", ())] == 1
    assert samples[("diffuserve_replica_busy", (("replica", "0"),))] == 1
    assert samples[("diffuserve_replica_rows", (("replica", "0"),))] == 9
    assert samples[("diffuserve_replica_healthy", (("replica", "1"),))] == 0
    EngineStatus(EngineState.READY).mirror_into(metrics)
    assert "diffuserve_draining 0.0" in metrics.render()[0].decode().splitlines()


def test_remote_client_shows_the_pushed_status_with_its_own_drain():
    client = RemoteEngineClient(proc=None, conn=None)  # type: ignore[arg-type]
    assert client.status().state == EngineState.LOADING
    pushed = EngineStatus(
        EngineState.READY, num_queued=2, num_pending=3, adapters_in_use=("style",), pipeline={"family": "flux"}
    )
    client._handle(m.Status(pushed, {"r1": (1, 4)}))
    assert client.status() == pushed and client.state == EngineState.READY
    client._requests["r1"] = None  # type: ignore[assignment]
    assert client.progress("r1") == (1, 4)
    client._draining = True  # a drain begun here, not seen by the engine process yet
    client._handle(m.Status(pushed, {}))
    assert client.status() == dataclasses.replace(pushed, state=EngineState.DRAINING)


def _members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return names | set(inspect.get_annotations(protocol))


@pytest.mark.parametrize("scheduler", [RequestLevelScheduler, StepScheduler])
def test_both_schedulers_implement_every_verb_of_the_protocol(scheduler):
    from diffuserve.engine.scheduler import BatchingConfig

    instance = scheduler(BatchingConfig(mode="dynamic", max_size=4, max_adapters=2), model_names=["fake"])
    missing = {n for n in _members(RequestScheduler) if not hasattr(instance, n)}
    assert not missing, f"{scheduler.__name__} lacks {sorted(missing)}"
    assert instance.activation_budget is None and instance.config.max_adapters == 2  # one config for both modes
