"""The parts every native family shares: per-request seeds and noise, CFG, and the denoising loop.

A family adapter supplies the transformer call for one step (`predict(latents, timestep, cond)`)
and its conditioning objects; this module owns the loop around it: classifier-free guidance,
scheduler steps, progress and cancellation between steps.

Seeds: row `j` of a request (0 <= j < n) is drawn from its own CPU generator seeded with
`seed + j`. So a request's noise is the same whether it runs alone or merged with others, the same
on CPU and CUDA, and the diffusers backend (which takes one generator per output row) reproduces it.
For n == 1 this is exactly `diffusers` with `generator=torch.Generator().manual_seed(seed)`.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from diffuserve.errors import RequestCancelledError

if TYPE_CHECKING:
    from diffuserve.engine.request import SamplingParams
    from diffuserve.pipelines.base import StepCallback, StopCheck

T = TypeVar("T")

MAX_SEED = 2**63 - 1
"""Seeds are drawn below this so that `seed + j` still fits torch's 64-bit generator seed."""


# -- seeds and noise ------------------------------------------------------------------------------------


def resolve_seed(seed: int | None) -> int:
    """The seed to use: `seed` itself, or a fresh random one when the request left it unset."""
    if seed is None:
        return random.SystemRandom().randrange(MAX_SEED)
    return int(seed)


def row_seeds(params: SamplingParams, seed: int | None = None) -> list[int]:
    """The generator seeds of a request's `n` rows: `seed + j` for row j."""
    base = resolve_seed(params.seed if seed is None else seed)
    return [base + j for j in range(params.n)]


def row_generators(batch: Sequence[SamplingParams]) -> list[torch.Generator]:
    """One CPU generator per output row of the batch, in row order (request by request).

    CPU generators keep the noise identical across devices; diffusers' `randn_tensor` draws on the
    CPU and moves the result when the target device differs.
    """
    return [torch.Generator("cpu").manual_seed(s) for params in batch for s in row_seeds(params)]


def batch_noise(
    batch: Sequence[SamplingParams],
    row_shape: Sequence[int],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Initial noise of shape (rows, *row_shape): each row drawn from its own generator."""
    from diffusers.utils.torch_utils import randn_tensor

    generators = row_generators(batch)
    return randn_tensor((len(generators), *row_shape), generator=generators, device=device, dtype=dtype)


def check_batch(batch: Sequence[SamplingParams]) -> SamplingParams:
    """The batch's head, after checking it is non-empty and every request shares its signature.

    The scheduler only merges equal signatures; this catches a caller that did not, naming the
    field, instead of silently running every request with the head's settings.
    """
    from diffuserve.engine.request import signature_difference

    if not batch:
        raise ValueError("a pipeline batch needs at least one request")
    head = batch[0]
    for i, params in enumerate(batch[1:], start=1):
        diff = signature_difference(head, params)
        if diff is not None:
            raise ValueError(
                f"request {i} of the batch differs from request 0 in {diff}; it cannot share the call"
            )
    return head


def num_rows(batch: Sequence[SamplingParams]) -> int:
    """Rows of the batch: the sum of every request's `n`."""
    return sum(params.n for params in batch)


def repeat_per_row(tensor: torch.Tensor, batch: Sequence[SamplingParams]) -> torch.Tensor:
    """Expand one entry per request (dim 0) to one per output row (request i repeated n_i times)."""
    counts = [params.n for params in batch]
    if all(c == 1 for c in counts):
        return tensor
    return tensor.repeat_interleave(torch.tensor(counts, device=tensor.device), dim=0)


def split_rows(rows: Sequence[T], batch: Sequence[SamplingParams]) -> list[list[T]]:
    """Split per-row outputs back per request: request i owns the next n_i rows."""
    if len(rows) != num_rows(batch):
        raise ValueError(f"cannot split {len(rows)} outputs over requests that own {num_rows(batch)} rows")
    out: list[list[T]] = []
    start = 0
    for params in batch:
        out.append(list(rows[start : start + params.n]))
        start += params.n
    return out


# -- classifier-free guidance ---------------------------------------------------------------------------

PredictFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
"""predict(latents, timestep, cond) -> model output; `cond` is the adapter's conditioning object."""


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The CFG combination, in the operand order diffusers uses (so results match bit for bit)."""
    return uncond + scale * (cond - uncond)


class Guidance(Protocol):
    """How one step's model output is formed from the positive (and negative) conditioning.

    This is the split point for CFG parallel: a distributed strategy runs the two branches on two
    ranks and gathers them, without the loop changing.
    """

    def predict(
        self, predict: PredictFn, latents: torch.Tensor, timestep: torch.Tensor, positive: Any, negative: Any
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class NoGuidance:
    """One model call per step on the positive conditioning (CFG off)."""

    def predict(self, predict: PredictFn, latents, timestep, positive, negative) -> torch.Tensor:
        return predict(latents, timestep, positive)


@dataclass(frozen=True)
class SequentialCFG:
    """Two model calls per step (positive, then negative), as `diffusers.FluxPipeline` does."""

    scale: float = 1.0
    """CFG scale (> 1 to have an effect)."""

    def predict(self, predict: PredictFn, latents, timestep, positive, negative) -> torch.Tensor:
        cond = predict(latents, timestep, positive)
        uncond = predict(latents, timestep, negative)
        return combine_cfg(cond, uncond, self.scale)


@dataclass(frozen=True)
class BatchedCFG:
    """One model call on the doubled batch; `concat(positive, negative)` stacks the conditioning."""

    scale: float = 1.0
    """CFG scale (> 1 to have an effect)."""
    concat: Callable[[Any, Any], Any] | None = None
    """Stacks two conditioning objects along the batch dimension (supplied by the adapter)."""

    def predict(self, predict: PredictFn, latents, timestep, positive, negative) -> torch.Tensor:
        if self.concat is None:
            raise TypeError("BatchedCFG needs the adapter's `concat` for its conditioning objects")
        both = predict(
            torch.cat([latents, latents]), torch.cat([timestep, timestep]), self.concat(positive, negative)
        )
        cond, uncond = both.chunk(2)
        return combine_cfg(cond, uncond, self.scale)


# -- the loop ---------------------------------------------------------------------------------------------


def fresh_scheduler(template: Any) -> Any:
    """A private copy of a scheduler whose timesteps are already set.

    Stepping only rebinds attributes (`_step_index`, ...) on the copy, so a shallow copy is enough
    and the cached template (and its timestep tensors) are never mutated by a run.
    """
    scheduler = copy.copy(template)
    scheduler._step_index = None
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    return scheduler


def denoise(
    *,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    scheduler: Any,
    predict: PredictFn,
    positive: Any,
    negative: Any = None,
    guidance: Guidance | None = None,
    on_step: StepCallback | None = None,
    should_stop: StopCheck | None = None,
) -> torch.Tensor:
    """Run the denoising loop and return the final latents.

    `should_stop()` is checked before every step, so a cancellation requested during step i takes
    effect as soon as that step finishes: RequestCancelledError leaves the loop. `on_step(i, n)` is
    called after step i.
    """
    guidance = guidance or NoGuidance()
    num_steps = len(timesteps)
    for i, t in enumerate(timesteps):
        if should_stop is not None and should_stop():
            raise RequestCancelledError(f"cancelled before denoising step {i + 1}/{num_steps}")
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        noise_pred = guidance.predict(predict, latents, timestep, positive, negative)
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if on_step is not None:
            on_step(i, num_steps)
    return latents


class StageTimer:
    """Collects wall time per named stage for BatchResult.stage_seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
