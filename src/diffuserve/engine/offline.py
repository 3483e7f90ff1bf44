"""The serving engine driven from synchronous code: `generate` runs its prompts through the same `AsyncEngine` as
`serve` (as vLLM's offline `LLM` reuses its engine core), so batching modes, overlap, deadlines and faults behave
the same in both.

The engine answers on an asyncio loop; `OfflineEngine` runs one in a daemon thread and hands the caller
`concurrent.futures.Future`s, whose waits a Ctrl-C interrupts in the main thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from diffuserve.engine.engine import AsyncEngine, EngineState
from diffuserve.engine.request_book import GenerationResult
from diffuserve.errors import GenerationError, RequestCancelledError
from diffuserve.sampling import ModelDescription, SamplingParams

logger = logging.getLogger("diffuserve")


@dataclass
class Submitted:
    """One request handed to the engine."""

    request_id: str
    """The engine's id of it (for `progress` and `abort`)."""
    params: SamplingParams
    """What was asked."""
    result: Future[GenerationResult]
    """Resolves to its result, or raises its error (GenerationError, RequestTimeoutError, ...)."""


class OfflineEngine:
    """An in-process `AsyncEngine` with a synchronous client: start, submit, wait, close."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="diffuserve-offline-loop", daemon=True)
        self._submitted: list[Submitted] = []
        self.step_cache: dict[str, list[int]] = {}
        """Step-cache method -> [computed, reused] denoising steps over the answers so far (summed over rows; what
        `serve` exports as `diffuserve_step_cache_steps`)."""

    def start(self) -> ModelDescription:
        """Load the model (in the engine's worker thread) and wait until it serves; returns its description.
        A load failure is raised as the loader raised it (a CheckpointError stays one)."""
        self._thread.start()
        self.engine.start()
        self.engine.wait_ready()
        if self.engine.state is not EngineState.READY:
            if self.engine.load_error is not None:
                raise self.engine.load_error
            raise GenerationError(f"the model failed to load: {self.engine.failure}")
        model = self.engine.model
        assert model is not None
        return model

    def submit_all(self, batch: Sequence[SamplingParams]) -> list[Submitted]:
        """Admit every request at once (the scheduler sees them together, as one arrival)."""

        async def admit() -> list[Submitted]:
            with self.engine.admitting_together():
                return [self._admit(params) for params in batch]

        made = asyncio.run_coroutine_threadsafe(admit(), self._loop).result()
        self._submitted += made
        return made

    def _admit(self, params: SamplingParams) -> Submitted:
        request_id = uuid.uuid4().hex
        answer = self.engine.submit(params, request_id=request_id)
        result: Future[GenerationResult] = Future()

        def deliver(done: asyncio.Future[GenerationResult]) -> None:
            if done.cancelled():
                result.cancel()
            elif done.exception() is not None:
                result.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                counts = done.result().output.step_cache
                if counts:
                    tally = self.step_cache.setdefault(str(counts.get("method")), [0, 0])
                    tally[0] += int(counts.get("computed_steps", 0))
                    tally[1] += int(counts.get("reused_steps", 0))
                result.set_result(done.result())

        answer.add_done_callback(deliver)
        return Submitted(request_id, params, result)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request; None while queued or once answered."""
        return self.engine.progress(request_id)

    def interrupt(self, request_id: str) -> tuple[int, int] | None:
        """Cancel a request (Ctrl-C) and return its (steps done, total) as the cancel lands, both under the engine's
        lock: the batch finishes the step in flight, then stops, and logs that step ("stopped at step k/N",
        k = done + 1). None: it was not running."""
        with self.engine.book.cond:
            progress = self.engine.progress(request_id)
            self.engine.abort(request_id, RequestCancelledError("interrupted (Ctrl-C)"))
        return progress

    def log_step_cache(self) -> None:
        """One line per step-cache method that ran: the steps it computed and reused."""
        for method, (computed, reused) in self.step_cache.items():
            logger.info(
                "step cache %s: computed %d, reused %d denoising steps (%.0f%% reused; summed over rows)",
                method,
                computed,
                reused,
                100 * reused / max(1, computed + reused),
            )

    def close(self) -> None:
        """Cancel what is still queued or running (a running batch stops at its next step), stop the engine and
        its executor (the other ranks, if any)."""
        for submitted in self._submitted:
            if not submitted.result.done():
                self.engine.abort(submitted.request_id)
        self.engine.stop()
        self.engine.executor.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
