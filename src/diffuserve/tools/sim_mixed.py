"""Mixed-size traffic on the simulated accelerator: size-grouped batches against token-budget batches with deficit
round-robin, through the real engine and schedulers (`bench_arrivals.py --simulate gpu --mixed`; docs/batching.md).

Per workload (sizes drawn uniformly from `MIXED_SIZES`, or the one-shape `ONE_SHAPE`) and per scheduler of
`SCHEDULERS`, in one run:

1. **saturation**: a closed loop of `clients` clients, each sending its next request when the previous one is
   answered, `requests` requests in all: throughput (requests / s);
2. **70 % load**: Poisson arrivals at `load` x the size-grouped scheduler's saturation throughput (the same seed,
   so the same arrivals and sizes, for both schedulers): mean latency and the p99 of the smallest size class.

The simulated step costs `a + b x rows + c x tokens` (`sim_executor.StepCost`); the token-budget scheduler's
pipeline packs mixed sizes (`SimulatedPipeline(packs_mixed_sizes=True)`: what `FamilySpec.packs_mixed_sizes` gives a
native family), the size-grouped one keeps one size per call (today's batching).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from diffuserve.tools.sim_executor import SimulatedExecutor, SimulatedPipeline, StepCost

MIXED_SIZES = ((256, 256), (384, 512), (512, 512), (512, 768))
"""The mixed workload's sizes (width, height), drawn uniformly."""
ONE_SHAPE = ((512, 512),)
"""The one-shape workload."""


@dataclass(frozen=True)
class SimScheduler:
    """One scheduler setting of the comparison."""

    packs: bool
    """The simulated pipeline packs mixed sizes (size leaves the batch signature)."""
    order: str
    """`--batching-order`."""
    max_tokens: int | None
    """`--batching-max-tokens` (None: the default, which never binds below the row cap here)."""


SCHEDULERS = {
    "size-grouped": SimScheduler(packs=False, order="fifo", max_tokens=None),
    "tokens+drr": SimScheduler(packs=True, order="drr", max_tokens=8 * 1024),
}
"""Today's batching (one size per batch, the queue head anchors) and the issue-31 one (mixed sizes up to 8 x 1024
tokens, deficit round-robin across the classes that remain)."""
ABLATION = {
    "size-grouped+drr": SimScheduler(packs=False, order="drr", max_tokens=None),
    "tokens (fifo)": SimScheduler(packs=True, order="fifo", max_tokens=8 * 1024),
}
"""`--mixed-ablation`: each half of the change alone (fair order without packing; packing without fair order)."""


def _engine(setting: SimScheduler, cost: StepCost, *, mode: str, max_size: int, delay_ms: float) -> Any:
    from diffuserve.engine.engine import AsyncEngine, EngineConfig
    from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
    from diffuserve.engine.step_scheduler import StepScheduler

    config = BatchingConfig(
        mode=mode, max_size=max_size, delay_ms=delay_ms, max_tokens=setting.max_tokens, order=setting.order
    )
    names = ["sim"]
    continuous = mode == "continuous"
    scheduler = (
        StepScheduler(config, model_names=names) if continuous else RequestLevelScheduler(config, model_names=names)
    )
    executor = SimulatedExecutor(make_pipeline=lambda: SimulatedPipeline(cost=cost, packs_mixed_sizes=setting.packs))
    engine = AsyncEngine(
        executor,
        scheduler,
        config=EngineConfig(max_queue_size=0, request_timeout_s=0.0, enable_warmup=False),
        model_name="sim",
    )
    engine.start()
    if not engine.wait_ready(60):
        raise RuntimeError(f"the simulated engine did not start: {engine.failure}")
    return engine


def _params(i: int, size: tuple[int, int], steps: int) -> Any:
    from diffuserve.sampling import SamplingParams

    return SamplingParams(prompt=f"request {i}", width=size[0], height=size[1], num_inference_steps=steps, seed=i)


def _sizes(sizes: tuple[tuple[int, int], ...], count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [rng.choice(sizes) for _ in range(count)]


def saturation_rps(engine: Any, sizes: list[tuple[int, int]], *, clients: int, steps: int) -> float:
    """Requests / s of a closed loop of `clients` clients sending `sizes` in order (one request each)."""
    todo = list(enumerate(sizes))

    async def client() -> None:
        while todo:
            i, size = todo.pop(0)
            await engine.generate(_params(i, size, steps))

    async def drive() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return len(sizes) / (time.perf_counter() - started)

    return asyncio.run(drive())


def open_loop(engine: Any, sizes: list[tuple[int, int]], *, rate: float, steps: int, seed: int) -> list[tuple]:
    """(size, latency s) of Poisson arrivals at `rate` req/s carrying `sizes` in order."""
    from diffuserve.tools.bench_report import poisson_arrivals

    arrivals = poisson_arrivals(len(sizes), rate, random.Random(seed))

    async def one(i: int, at: float, start: float) -> tuple:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        await engine.generate(_params(i, sizes[i], steps))
        return sizes[i], time.perf_counter() - sent

    async def drive() -> list[tuple]:
        start = time.perf_counter()
        return list(await asyncio.gather(*(one(i, at, start) for i, at in enumerate(arrivals))))

    return asyncio.run(drive())


def compare(
    cost: StepCost,
    workload: tuple[tuple[int, int], ...],
    *,
    requests: int,
    clients: int,
    steps: int,
    load: float = 0.7,
    mode: str = "dynamic",
    max_size: int = 8,
    delay_ms: float = 5.0,
    seed: int = 0,
    schedulers: dict[str, SimScheduler] | None = None,
    baseline: str = "size-grouped",
) -> dict[str, dict[str, float]]:
    """Per scheduler of `SCHEDULERS`: saturation throughput, and at `load` x `baseline`'s: mean latency and the
    p99 of the smallest size class (ms)."""
    from diffuserve.tools.bench_report import percentile

    sizes = _sizes(workload, requests, seed)
    smallest = min(workload, key=lambda s: s[0] * s[1])
    settings = schedulers or SCHEDULERS
    results: dict[str, dict[str, float]] = {}
    for name, setting in settings.items():
        engine = _engine(setting, cost, mode=mode, max_size=max_size, delay_ms=delay_ms)
        try:
            results[name] = {"saturation_rps": saturation_rps(engine, sizes, clients=clients, steps=steps)}
        finally:
            engine.stop()
    rate = load * results[baseline]["saturation_rps"]
    for name, setting in settings.items():
        engine = _engine(setting, cost, mode=mode, max_size=max_size, delay_ms=delay_ms)
        try:
            answered = open_loop(engine, sizes, rate=rate, steps=steps, seed=seed + 1)
        finally:
            engine.stop()
        small = [latency for size, latency in answered if size == smallest]
        results[name] |= {
            "rate_rps": rate,
            "mean_ms": statistics.mean(latency for _, latency in answered) * 1000,
            "p99_smallest_ms": percentile(small, 99) * 1000,
        }
    return results


def report(
    label: str, results: dict[str, dict[str, float]], *, targets: bool, baseline: str = "size-grouped"
) -> list[str]:
    """The printed lines of one workload: each scheduler's figures, the ratios of `tokens+drr` to `baseline` and
    (`targets`) issue 31's targets."""
    lines = [
        f"{label} {name:12} saturation={r['saturation_rps']:.2f} req/s  at {r['rate_rps']:.2f} req/s: "
        f"mean={r['mean_ms']:.0f}ms p99(smallest size)={r['p99_smallest_ms']:.0f}ms"
        for name, r in results.items()
    ]
    old, new = results[baseline], results["tokens+drr"]
    throughput = new["saturation_rps"] / old["saturation_rps"]
    mean = new["mean_ms"] / old["mean_ms"]
    p99 = new["p99_smallest_ms"] / old["p99_smallest_ms"]
    lines.append(f"{label} tokens+drr / {baseline}: throughput {throughput:.2f}x, mean {mean:.2f}x, p99 {p99:.2f}x")
    if targets:
        lines.append(
            f"{label} targets: throughput >= 1.2x {'met' if throughput >= 1.2 else 'NOT met'}; mean <= 0.8x "
            f"{'met' if mean <= 0.8 else 'NOT met'}; p99 of the smallest size no worse "
            f"{'met' if p99 <= 1.0 else 'NOT met'}"
        )
    return lines
