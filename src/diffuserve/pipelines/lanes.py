"""Stage overlap: text encoding and VAE decode run beside the denoise loop, so the loop does not stop for them.

One `Lanes` per pipeline (`lanes_for`) holds two `SideLane`s, `encode` and `decode`: each is one daemon
thread that runs its jobs in submission order and, on CUDA, its own CUDA stream. The denoise loop (the engine's
worker thread) submits a job and goes on stepping; it picks the result up at a later step boundary (an encode:
the request joins the group then) or never (a decode: the lane answers the request itself through the callback
the engine gave it).

What makes it safe:

* **Streams (CUDA).** `submit` records an event on the caller's current stream; the lane's stream waits for it
  before the job runs, so the latents the loop just produced are complete, and the job's input tensors are
  `record_stream`-ed onto the lane's stream so the caching allocator does not hand their memory to the loop
  while the lane still reads them. The job ends with an event on the lane's stream; `SideResult.take()` makes
  the consumer's stream wait for it (and records the consumer's stream on the result's tensors) before GPU
  tensors the job made (an encode's conditioning) are used. On CPU there are no streams and both are no-ops.
* **The decoder runs in one thread at a time** (`Lanes.decoder_lock`, taken by every decode and preview):
  a layer-streamed VAE cannot serve two forwards at once, and previews (loop) share the VAE with decodes (lane).
  Likewise the text encoders (`encoder_lock`): a fast tokenizer is not thread-safe (its padding / truncation
  settings live on the object during a call), and a request-level batch on the loop's thread may encode while
  the encode lane still finishes a start.
* **Residency.** Each job enters its own component's scope (`residency.use`), which is thread-safe for
  different components at once and serialises load/unload of one component (`runtime/residency.py`). While a
  decode overlaps a step, the VAE's and the denoiser's weights are on the device together: an offloaded VAE
  adds its size to the step's peak (the price of not stopping the loop).

Observed state, not timing: `count_step()` is called by the loop after each denoising step, and every job
records `steps_beside`, the denoising steps that ran from its submission to its end. The engine turns these into the
`diffuserve_overlap_steps_total{stage}` metric; a job that blocked the loop would always see 0.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from diffuserve.runtime.cpu_time import PIPELINE_CPU

logger = logging.getLogger("diffuserve.overlap")

T = TypeVar("T")

HOLD_STEPS = 2
"""Fault injection (`hold:<marker>`): a side job of a marked request waits until this many denoising steps ran."""
HOLD_TIMEOUT_S = 30.0
"""... or at most this long (a loop that stopped for the job never steps, and the job must still finish)."""


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside `value` (dicts, lists, tuples, dataclasses, plain objects; a few levels deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 4:
        return
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name), depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        # e.g. a request's private scheduler copy, whose sigmas / timesteps were made on the encode lane's stream
        for item in vars(value).values():
            yield from _tensors(item, depth + 1)


@dataclass
class SideResult(Generic[T]):
    """What a side job returned, and what it saw of the loop."""

    value: T
    seconds: float
    """Wall time of the job (a hold included)."""
    steps_beside: int
    """Denoising steps the loop ran from the job's submission to its end (0 if the loop waited for it)."""
    event: Any = None
    """CUDA: an event on the lane's stream at the end of the job; None on CPU."""

    def take(self, device: torch.device) -> T:
        """The value, safe to use on the caller's current stream (waits for the lane's stream on CUDA)."""
        if self.event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.event)
            for tensor in _tensors(self.value):
                if tensor.is_cuda:
                    tensor.record_stream(stream)
        return self.value


class SideLane:
    """One daemon thread running jobs in submission order, with its own CUDA stream on a CUDA device."""

    def __init__(self, name: str, owner: Lanes):
        self.name = name
        self.owner = owner
        self.stream = torch.cuda.Stream(device=owner.device) if owner.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=f"diffuserve-{name}", daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[[], T], *, inputs: Sequence[Any] = (), prompts: Sequence[str] = ()
    ) -> Future[SideResult[T]]:
        """Run `fn()` in the lane. `inputs`: objects holding the tensors it reads (see the module docstring);
        `prompts`: the prompts of its requests (only the `hold:` fault injection reads them)."""
        future: Future[SideResult[T]] = Future()
        ready = None
        if self.stream is not None:
            ready = torch.cuda.current_stream(self.owner.device).record_event()
        self._jobs.put((fn, list(inputs), list(prompts), ready, self.owner.steps, future))
        return future

    def _main(self) -> None:
        while True:
            fn, inputs, prompts, ready, submitted_at_step, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._run(fn, inputs, prompts, ready, submitted_at_step))
            except BaseException as exc:  # the lane never dies; the submitter gets the error
                future.set_exception(exc)

    def _run(
        self, fn: Callable[[], T], inputs: list[Any], prompts: list[str], ready: Any, before: int
    ) -> SideResult[T]:
        owner = self.owner
        started = time.perf_counter()
        owner.maybe_hold(self.name, prompts, before)
        if self.stream is None:
            with PIPELINE_CPU.measure():
                value = fn()
            event = None
        else:
            with torch.cuda.stream(self.stream), PIPELINE_CPU.measure():
                self.stream.wait_event(ready)
                for tensor in _tensors(inputs):
                    if tensor.is_cuda:
                        tensor.record_stream(self.stream)
                value = fn()
                event = self.stream.record_event()
        return SideResult(
            value=value, seconds=time.perf_counter() - started, steps_beside=owner.steps - before, event=event
        )


class Lanes:
    """The encode and decode lanes of one pipeline, the loop's step counter and the decoder lock."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.decoder_lock = threading.RLock()
        """Held by every decode and preview (the VAE runs in one thread at a time)."""
        self.encoder_lock = threading.RLock()
        """Held by every text encode (tokenizers are not thread-safe)."""
        self.hold_marker: str | None = None
        """Fault injection only (`pipelines/fault_hooks.py`, `hold:<marker>`): side jobs of requests whose prompt
        contains it wait until the loop ran `HOLD_STEPS` more steps, so tests can observe the
        overlap deterministically."""
        self._steps = 0
        self._steps_changed = threading.Condition()
        self._lanes: dict[str, SideLane] = {}
        self._lanes_lock = threading.Lock()

    @property
    def encode(self) -> SideLane:
        return self._lane("encode")

    @property
    def decode(self) -> SideLane:
        return self._lane("decode")

    def _lane(self, name: str) -> SideLane:
        with self._lanes_lock:  # threads start on first use, so a process that never overlaps has none
            if name not in self._lanes:
                self._lanes[name] = SideLane(name, self)
            return self._lanes[name]

    @property
    def steps(self) -> int:
        """Denoising steps the loop has run so far (all batches, all modes)."""
        return self._steps

    def count_step(self) -> None:
        with self._steps_changed:
            self._steps += 1
            self._steps_changed.notify_all()

    def maybe_hold(self, stage: str, prompts: Sequence[str], since: int) -> None:
        marker = self.hold_marker
        if marker is None or not any(marker in p for p in prompts):
            return
        logger.warning("fault injection: holding a side %s until %d more denoising steps run", stage, HOLD_STEPS)
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        with self._steps_changed:
            while self._steps < since + HOLD_STEPS and time.monotonic() < deadline:
                self._steps_changed.wait(max(0.0, deadline - time.monotonic()))

    @contextmanager
    def decoder_scope(self, residency: Any, decoder: str) -> Iterator[None]:
        """The decoder lock, then the decoder's residency scope."""
        with self.decoder_lock, residency.use(decoder):
            yield


def lanes_for(pipeline: Any) -> Lanes:
    """The pipeline's `Lanes` (its own `lanes()`: made on first use, on the pipeline's device)."""
    return pipeline.lanes()
