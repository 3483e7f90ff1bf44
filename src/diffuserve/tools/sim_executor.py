"""A simulated accelerator for the engine: a pipeline without a model whose denoising steps cost what a cost model
says, run by the real executor seam (`InProcessExecutor`, a continuous `StepRunner`) under the real engine and
schedulers.

Two users:
- `tests/unit/test_engine.py` gates every step on a permit the test grants (`SimulatedPipeline.wait_turn`
  overridden), so it decides where every batch stands, with no model and no sleeps;
- `benchmarks/bench_arrivals.py --simulate gpu|cpu` lets each step take `a + b x rows + c x tokens` seconds
  (`StepCost`; tokens: the rows' latent tokens at a 16-pixel token side), so dynamic and continuous batching are
  compared on a GPU-like cost curve (`b << a`: a step of 8 small rows costs about one of 1) that this CPU-only
  machine cannot show, and on the CPU's measured curve; `--mixed` compares size-grouped batches with token-budget
  batches of mixed sizes (`tools/sim_mixed.py`, the pipeline built with `packs_mixed_sizes`).

A request's outputs name its prompt (`"<prompt>#<row>"`), so a test can see who got what; the text encode and
the decode cost nothing here (the model is the denoise loop's step cost alone).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffuserve.config.token_budget import row_tokens
from diffuserve.errors import RequestCancelledError
from diffuserve.executor.base import InProcessExecutor, ReplicaState, ServingPipeline
from diffuserve.executor.batch_runner import BatchEvents, BatchOutcome
from diffuserve.executor.messages import BatchMessage
from diffuserve.pipelines.base import Pipeline
from diffuserve.pipelines.recipe import DenoiseState
from diffuserve.pipelines.results import BatchResult, RequestOutput
from diffuserve.pipelines.step_batch import RequestRows
from diffuserve.sampling import SamplingParams

TOKEN_SIDE = 16
"""Pixels per latent token side of the simulated model (FLUX.1's 8 x 2)."""
WAIT_S = 20.0
"""How long a decode waits for a closed `decode_gate` at most (tests close it to hold a decode)."""


@dataclass(frozen=True)
class StepCost:
    """Seconds one denoising step of `rows` output rows holding `tokens` latent tokens takes:
    `a_s + b_s * rows + c_s * tokens`."""

    name: str
    """What the curve models (printed with the figures)."""
    a_s: float
    """Fixed cost of a step (kernel launches, weight reads: most of a GPU step at serving batch sizes)."""
    b_s: float
    """Added cost per row of the step (its text tokens, per-row modulation)."""
    c_s: float = 0.0
    """Added cost per latent token of the step (a call's cost grows with its total tokens, not its rows)."""

    def __call__(self, rows: int, tokens: int = 0) -> float:
        return self.a_s + self.b_s * rows + self.c_s * tokens


COST_MODELS = {
    # c: 8 ms per 1024 latent tokens (a 512x512 row at a 16-pixel token side), so a step of 8 such rows costs
    # about 2.6 of one (a ~1B DiT on a datacenter GPU); a 64x64 row (16 tokens) adds 0.125 ms to b.
    "gpu": StepCost("gpu (a=40 ms, b=1 ms/row, c=8 ms/1024 tokens)", 0.040, 0.001, 0.008 / 1024),
    # Measured: tiny FLUX at 64x64, 4 steps, benchmarks/results/bench_batching.txt: one image per call 21.3 ms
    # (47.0 img/s), eight per call 50.0 ms (160.2 img/s), so a call costs 17.2 ms + 4.1 ms/row; per step (4 of
    # them, the encode and decode folded in) 4.3 ms + 1.0 ms/row.
    "cpu": StepCost("cpu (tiny 64px measured: a=4.3 ms, b=1.0 ms/row)", 0.0043, 0.0010),
}
"""The cost curves of `bench_arrivals.py --simulate`."""


@dataclass
class _Denoised:
    batch: list[SamplingParams]
    latents: torch.Tensor
    stage_seconds: dict[str, float]


class SimulatedPipeline(Pipeline):
    """A pipeline without a model: each denoising step waits its turn (`wait_turn`: the step's cost by default),
    then counts; outputs name their request's prompt. Continuous batching steps it through `SimulatedSteps`."""

    family = "simulated"
    supports_batching = True
    supports_continuous = True
    size_multiple = TOKEN_SIDE

    def __init__(self, *, cost: StepCost | None = None, defers_decode: bool = False, packs_mixed_sizes: bool = False):
        super().__init__()
        self.packs_mixed_sizes = packs_mixed_sizes
        """Rows of different sizes share a call (the schedulers merge them: `FamilySpec.packs_mixed_sizes`)."""
        self._tokens = 0
        """Latent tokens of the step about to run (`wait_turn` charges them)."""
        self.device = torch.device("cpu")
        self.cost = cost
        """The step cost slept by `wait_turn`; None: steps cost nothing."""
        self._defers_decode = defers_decode
        self._changed = threading.Condition()
        self.steps_run = 0
        """Denoising steps run (request-level calls and continuous steps alike)."""
        self.calls: list[list[str]] = []
        """Prompts of each request-level call, in order."""
        self.step_rows: list[list[str]] = []
        """Continuous mode: prompts of the rows of each step."""
        self.decode_gate = threading.Event()
        """Decodes wait while it is clear (tests hold a decode with it)."""
        self.decode_gate.set()
        self.decodes: list[list[str]] = []
        """Prompts (request-level) or row labels (continuous) of each decode, in order."""

    def wait_turn(self, prompts: Sequence[str], rows: int) -> None:
        """Before a step of `rows` rows: take the step's time."""
        if self.cost is not None:
            time.sleep(self.cost(rows, self._tokens))

    def step(self, prompts: Sequence[str], rows: int, tokens: int = 0) -> None:
        """One denoising step of `tokens` latent tokens (a prompt containing FAIL fails it)."""
        self._tokens = tokens
        self.wait_turn(prompts, rows)
        if any("FAIL" in p for p in prompts):
            raise RuntimeError("injected step failure")
        with self._changed:
            self.steps_run += 1

    @property
    def defers_decode(self) -> bool:  # type: ignore[override]
        return self._defers_decode

    def run_to_latents(
        self, batch: list[SamplingParams], *, on_step: Any = None, should_stop: Any = None, on_preview: Any = None
    ) -> Any:
        prompts = [p.prompt for p in batch]
        self.calls.append(prompts)
        rows = sum(p.n for p in batch)
        num_steps = batch[0].num_inference_steps
        tokens = sum(p.n * sim_tokens(p) for p in batch)
        for i in range(num_steps):
            if should_stop is not None and should_stop():
                raise RequestCancelledError(f"cancelled before denoising step {i + 1}/{num_steps}")
            self.step(prompts, rows, tokens)
            if on_step is not None:
                on_step(i, num_steps)
            if on_preview is not None:
                on_preview(i, num_steps, lambda i=i: [[f"{p.prompt}@{i}"] * p.n for p in batch])
        return _Denoised(list(batch), torch.zeros(rows, 1), {"denoise": 0.0})

    def decode_batch(self, denoised: Any) -> BatchResult:
        self.decode_gate.wait(WAIT_S)
        self.decodes.append([p.prompt for p in denoised.batch])
        return BatchResult(
            outputs=[
                RequestOutput(images=[f"{p.prompt}#{j}" for j in range(p.n)])  # type: ignore[misc]
                for p in denoised.batch
            ],
            stage_seconds={"decode": 0.0},
        )

    def run(
        self, batch: list[SamplingParams], *, on_step: Any = None, should_stop: Any = None, on_preview: Any = None
    ) -> BatchResult:
        return self.decode_batch(
            self.run_to_latents(batch, on_step=on_step, should_stop=should_stop, on_preview=on_preview)
        )

    def decode(self, labels: list[str]) -> list[Any]:
        """Continuous mode's finish: the final outputs of rows labelled by their prompts."""
        self.decode_gate.wait(WAIT_S)
        self.decodes.append(list(labels))
        return [f"{label}#final" for label in labels]


def sim_tokens(params: SamplingParams) -> int:
    """Latent tokens of one row of `params` on the simulated model."""
    return row_tokens(params.width, params.height, token_side=TOKEN_SIDE)


def _rows(params: SamplingParams) -> RequestRows:
    latents = torch.zeros(params.n, 1)
    state = DenoiseState(
        latents=latents,
        timesteps=torch.arange(params.num_inference_steps),
        scheduler=None,
        extras={"labels": [params.prompt] * params.n},
    )
    return RequestRows(params=params, latents=latents, positive=None, negative=None, state=state)  # type: ignore[arg-type]


class SimulatedSteps:
    """Continuous batching's `StepRunner` on a simulated pipeline: a request's state is `RequestRows` with rows
    labelled by its prompt (a prompt containing BADSTART fails its start alone)."""

    def __init__(self, pipeline: SimulatedPipeline):
        self.pipeline = pipeline
        self.dropped: list[str] = []
        """Requests that left the group early, in order."""
        self.lanes = None
        self.device = pipeline.device

    def start(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[Any]:
        return [
            RuntimeError("injected start failure") if "BADSTART" in params.prompt else _rows(params)
            for _, params in requests
        ]

    def step(self, rows: Sequence[tuple[str, Any]]) -> None:
        prompts = [state.params.prompt for _, state in rows]
        self.pipeline.step_rows.append(prompts)
        tokens = sum(state.params.n * sim_tokens(state.params) for _, state in rows)
        self.pipeline.step(prompts, sum(state.params.n for _, state in rows), tokens)
        for _, state in rows:
            state.step_index += 1

    def drop(self, request_id: str) -> None:
        self.dropped.append(request_id)

    def snapshot(self, state: Any) -> Any:
        return state

    def preview(self, state: Any) -> list[Any]:
        return [f"{label}#preview" for label in state.state.extras["labels"]]

    def finish(self, states: Sequence[Any]) -> list[RequestOutput]:
        decoded = iter(self.pipeline.decode([label for s in states for label in s.state.extras["labels"]]))
        return [RequestOutput(images=[next(decoded) for _ in range(s.params.n)]) for s in states]


class SimulatedExecutor:
    """`replicas` simulated pipelines, each run by the in-process executor of its own replica; records every
    batch. `make_pipeline()` builds each replica's pipeline."""

    multi_rank = False

    def __init__(
        self,
        replicas: int = 1,
        *,
        make_pipeline: Callable[[], SimulatedPipeline] = SimulatedPipeline,
        clock: Callable[[], float] | None = None,
    ):
        self.pipelines = [make_pipeline() for _ in range(replicas)]
        self._inner = [InProcessExecutor(lambda p=p: ServingPipeline.of(p), clock=clock) for p in self.pipelines]
        self.replicas = [ReplicaState(r, (r,)) for r in range(replicas)]
        self.batches: list[tuple[int, list[str]]] = []
        """(replica, request prompts) of every executed batch, in order."""
        self.runner: SimulatedSteps | None = None

    @property
    def pipeline(self) -> SimulatedPipeline:
        return self.pipelines[0]

    def load(self) -> ServingPipeline:
        return [inner.load() for inner in self._inner][0]

    def execute(self, replica: int, message: BatchMessage, events: BatchEvents) -> BatchOutcome:
        self.batches.append((replica, [p.prompt for p in message.params]))
        return self._inner[replica].execute(0, message, events)

    def prefetch(self, params: SamplingParams, on_done: Callable[[int], None]) -> bool:
        return False

    def steps(self) -> SimulatedSteps:
        self.runner = SimulatedSteps(self.pipelines[0])
        return self.runner

    def shutdown(self) -> None:
        pass

    def describe(self) -> dict[str, Any] | None:
        return None


# -- Poisson arrivals through the real engine on the simulated accelerator (`bench_arrivals.py --simulate`) -----

SIM_MODES = {"singleton": (1, 0.0), "dynamic": (8, 5.0), "continuous": (8, 0.0)}
"""Batching mode -> (--batching-max-size, --batching-delay-ms): the servers of `bench_arrivals.py`."""


def singleton_capacity_rps(cost: StepCost, steps: int) -> float:
    """Requests per second one-at-a-time serving manages on `cost` (the simulated step time alone)."""
    return 1.0 / (steps * cost(1))


def simulate_arrivals(
    mode: str, cost: StepCost, *, rate: float, requests: int, steps: int, seed: int = 0
) -> list[float]:
    """Latencies (s, arrival to answer) of `requests` Poisson arrivals at `rate` req/s, each of `steps` steps and
    one row, through the real `AsyncEngine` and the scheduler of `mode` (`SIM_MODES`) on a simulated accelerator
    whose steps cost `cost`."""
    import asyncio
    import random

    from diffuserve.engine.engine import AsyncEngine, EngineConfig
    from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
    from diffuserve.engine.step_scheduler import StepScheduler
    from diffuserve.tools.bench_report import poisson_arrivals

    max_size, delay_ms = SIM_MODES[mode]
    config = BatchingConfig(mode=mode, max_size=max_size, delay_ms=delay_ms)
    scheduler = (
        StepScheduler(config, model_names=["sim"])
        if mode == "continuous"
        else RequestLevelScheduler(config, model_names=["sim"])
    )
    engine = AsyncEngine(
        SimulatedExecutor(make_pipeline=lambda: SimulatedPipeline(cost=cost)),
        scheduler,
        config=EngineConfig(max_queue_size=0, request_timeout_s=0.0, enable_warmup=False),
        model_name="sim",
    )
    engine.start()
    if not engine.wait_ready(60):
        raise RuntimeError(f"the simulated engine did not start: {engine.failure}")
    arrivals = poisson_arrivals(requests, rate, random.Random(seed))

    async def one(i: int, at: float, start: float) -> float:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        params = SamplingParams(prompt=f"request {i}", width=64, height=64, num_inference_steps=steps, seed=i)
        await engine.generate(params)
        return time.perf_counter() - sent

    async def drive() -> list[float]:
        start = time.perf_counter()
        return list(await asyncio.gather(*(one(i, at, start) for i, at in enumerate(arrivals))))

    try:
        return asyncio.run(drive())
    finally:
        engine.stop()
