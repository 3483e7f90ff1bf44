"""The pieces of a batch the recipe (`pipelines/recipe.py`) and the continuous steps (`step_batch.py`) share, pure
functions and small types: per-row seeds and noise, splitting rows back per request, the CFG combine, private
scheduler copies, stage timing, conditioning rows (gather, pad, stack) and the state `prepare` hands the loop.

Seeds: row `j` of a request (0 <= j < n) is drawn from its own CPU generator seeded with `seed + j`. So a request's
noise is the same whether it runs alone or merged with others, the same on CPU and CUDA, and the diffusers backend
(which takes one generator per output row) reproduces it. For n == 1 this is exactly `diffusers` with
`generator=torch.Generator().manual_seed(seed)`.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from PIL import Image

    from diffuserve.sampling import SamplingParams

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


def check_batch(batch: Sequence[SamplingParams], strength_per_row: bool = False) -> SamplingParams:
    """The batch's head, after checking it is non-empty and every request shares its signature (less `strength`
    for a family whose edits of different strengths share a call: `sampling.row_fields`).

    The scheduler only merges equal signatures; this catches a caller that did not, naming the
    field, instead of silently running every request with the head's settings.
    """
    from diffuserve.sampling import row_fields, signature_difference

    if not batch:
        raise ValueError("a pipeline batch needs at least one request")
    head = batch[0]
    for i, params in enumerate(batch[1:], start=1):
        diff = signature_difference(head, params, row_fields(head, params, strength=strength_per_row))
        if diff is not None:
            raise ValueError(f"request {i} of the batch differs from request 0 in {diff}; it cannot share the call")
    return head


def num_rows(batch: Sequence[SamplingParams]) -> int:
    """Rows of the batch: the sum of every request's `n`."""
    return sum(params.n for params in batch)


def rows_per_request(rows: Sequence[T], batch: Sequence[SamplingParams]) -> list[list[T]]:
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


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The CFG combination, in the operand order diffusers uses (so results match bit for bit)."""
    return uncond + scale * (cond - uncond)


# -- the loop's helpers -----------------------------------------------------------------------------------


def has_flow_shift(scheduler: Any) -> bool:
    """Whether `scheduler` is a flow-matching scheduler with a sigma shift a request's `flow_shift` can set:
    FlowMatchEuler's `shift`, or `flow_shift` of a multistep solver over flow sigmas (Wan's UniPC)."""
    config = scheduler.config
    return "shift" in config or ("flow_shift" in config and bool(config.get("use_flow_sigmas", False)))


def scheduler_template(scheduler: Any, flow_shift: float | None) -> Any:
    """A new scheduler from the checkpoint's config; with `flow_shift`, its static shift is that value and dynamic
    (resolution-dependent) shifting is off, as SGLang-Diffusion and FastVideo apply their `flow_shift`."""
    if flow_shift is None:
        return scheduler.__class__.from_config(scheduler.config)
    key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
    return scheduler.__class__.from_config(scheduler.config, **{key: flow_shift, "use_dynamic_shifting": False})


def fresh_scheduler(template: Any) -> Any:
    """A private copy of a scheduler whose timesteps are already set.

    The cached template (and its timestep tensors) are never mutated by a run.
    """
    # A deep copy: multistep solvers (UniPC, DPM-Solver++) keep their history in lists they update in place,
    # which a shallow copy would share with the cached template (tiny objects: a few tensors of `steps` floats).
    scheduler = copy.deepcopy(template)
    scheduler._step_index = None
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    return scheduler


SCHEDULE_CACHE_SIZE = 64
"""Schedules a pipeline keeps (per step count, shape and shift); cleared past this many, so a stream of requests
with ever new sizes or step counts cannot grow memory without bound."""


def cached_schedule(
    cache: dict[Any, tuple[Any, torch.Tensor]], key: Any, build: Callable[[], tuple[Any, torch.Tensor]]
) -> tuple[Any, torch.Tensor]:
    """A private scheduler and its timesteps for `key`: `build()` makes the template (a scheduler with its timesteps
    set) once per key; every call gets its own copy of it (`fresh_scheduler`)."""
    if key not in cache:
        if len(cache) >= SCHEDULE_CACHE_SIZE:
            cache.clear()
        cache[key] = build()
    template, timesteps = cache[key]
    return fresh_scheduler(template), timesteps


def dynamic_shift_mu(config: Any, image_seq_len: int, *, max_shift: float = 1.15) -> float:
    """diffusers' `calculate_shift` (the same function in every flow-matching pipeline) for `image_seq_len` tokens,
    with the scheduler config's bounds, or the pipelines' defaults where the config has none."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )


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


# -- conditioning rows --------------------------------------------------------------------------------------

Cond = dict[str, torch.Tensor]
"""A batch's conditioning: named tensors, each with one row per output on dim 0."""


def pad_to(tensor: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """`tensor` zero-padded along `dim` to `length` (masks pad with 0 = ignored)."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def gather_rows(encoded: Cond, index: torch.Tensor, masked: dict[str, str] | None = None) -> Cond:
    """Rows `index` of every tensor. `masked` maps a sequence key to its attention-mask key: trailing columns
    that every selected row pads are cut (to the longest selected text), so a row sees the same sequence
    whether or not longer texts shared its encoder call."""
    rows = {k: v.index_select(0, index.to(v.device)) for k, v in encoded.items()}
    for seq_key, mask_key in (masked or {}).items():
        mask = rows[mask_key]
        length = int(mask.sum(dim=1).max().item()) if mask.numel() else 0
        if length < mask.shape[1]:
            rows[seq_key] = rows[seq_key][:, :length]
    for mask_key in set((masked or {}).values()):
        mask = rows[mask_key]
        length = int(mask.sum(dim=1).max().item()) if mask.numel() else 0
        rows[mask_key] = mask[:, :length]
    return rows


def concat_cond(a: Cond, b: Cond, masked: dict[str, str] | None = None) -> Cond:
    """Two conditionings stacked on dim 0 (batched CFG); masked sequences of different lengths are padded
    (their masks mark the padding)."""
    padded = set(masked or {}) | set((masked or {}).values())
    out: Cond = {}
    for key in a:
        x, y = a[key], b[key]
        if key in padded and x.shape[1] != y.shape[1]:
            length = max(x.shape[1], y.shape[1])
            x, y = pad_to(x, length), pad_to(y, length)
        out[key] = torch.cat([x, y])
    return out


@dataclass
class DenoiseState:
    """What `prepare` hands the loop: the starting latents, the schedule, and per-batch extras."""

    latents: torch.Tensor
    """Initial latents, one row per output."""
    timesteps: torch.Tensor
    """The timesteps to run, in order."""
    scheduler: Any
    """A private scheduler for this batch (`fresh_scheduler`)."""
    extras: dict[str, Any]
    """Per-batch values the adapter's predict/decode need (position ids, guidance vector, image latents)."""


@dataclass
class Denoised:
    """A batch after its denoising loop (`run_to_latents`), before its decode (`decode_batch`)."""

    batch: list[SamplingParams]
    latents: torch.Tensor
    """The final latents, one row per output."""
    state: DenoiseState
    stage_seconds: dict[str, float]
    """Seconds of the stages run so far."""
    row_caches: list[Any] | None = None
    """The step cache (`step_cache.RowCache`) of each row (None: the batch ran none), for the per-request counts in
    `timings`."""


def to_pil_images(images: torch.Tensor) -> list[Image.Image]:
    """(rows, 3, H, W) in [-1, 1] -> PIL images, with the rounding diffusers' image processor uses."""
    from PIL import Image

    array = (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    array = (array * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in array]
