"""ControlNet rows in the recipe, shared by the family adapters that run one (`families/<family>/controlnet.py`).

A request's ControlNet conditioning (`SamplingParams.control`) is carried by its rows: at `prepare` each of its
output rows gets a `ControlRow` (its ControlNet, its encoded control image, mode, scale, step window and its own
positive conditioning), `None` for a plain row, in `state.extras["control"]`. At every denoiser call the rows are
grouped by ControlNet; each ControlNet runs once on its rows that are inside their step window, and its residuals
are scattered back to their rows (zeros elsewhere: adding 0 leaves a plain row exactly as it is), so a row in a
mixed batch equals the same request alone, and each equals the family's diffusers ControlNet pipeline.

As in diffusers, the ControlNet sees the positive prompt only and both CFG branches add the same residuals (the
second branch of a step reuses the first's: `step_residuals`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diffuserve.family_spec.request_rules import control_name

if TYPE_CHECKING:
    from diffuserve.sampling import SamplingParams

EXTRAS_KEY = "control"
"""The `DenoiseState.extras` key of a batch's `ControlRows`."""


@dataclass
class LoadedControlNet:
    """One loaded ControlNet, as the adapters read it (`pipelines/controlnet.py`)."""

    name: str
    """The name requests select it by."""
    key: str
    """Its component key (residency scope)."""
    model: Any
    """The diffusers model (FluxControlNetModel, ...)."""
    class_name: str
    """Its class name."""

    @property
    def num_modes(self) -> int | None:
        """Control modes of a Union ControlNet (`num_mode` in its config); None for a single-purpose one."""
        value = getattr(self.model.config, "num_mode", None)
        return int(value) if value else None


@dataclass
class ControlRow:
    """One output row's ControlNet conditioning."""

    controlnet: LoadedControlNet
    cond: torch.Tensor
    """The ControlNet's conditioning input for this row (FLUX.1: the packed VAE latents of the control image)."""
    mode: int | None
    scale: float
    start: float
    end: float
    schedule: torch.Tensor
    """The row's own timesteps (the step window is a share of them; continuous steps mix schedules)."""
    guidance: float
    """The request's guidance scale (guidance-embedding ControlNets take it)."""
    text: dict[str, torch.Tensor] = field(default_factory=dict)
    """The row's positive conditioning (one row each), for families whose ControlNet sees the positive prompt only
    (FLUX.1); empty where it runs on both CFG branches with the DiT's own conditioning (SD3)."""
    uncond: torch.Tensor | None = None
    """The row's conditioning input in the unconditional CFG branch, where the family's pipeline samples it apart
    (SD3); None: the same as `cond`."""

    def keep(self, timestep: torch.Tensor) -> float:
        """diffusers' `controlnet_keep` at this row's step: 1 inside [start, end] of the steps, 0 outside."""
        n = len(self.schedule)
        i = int((self.schedule == timestep.to(self.schedule.device, self.schedule.dtype)).nonzero()[0, 0])
        return 1.0 - float(i / n < self.start or (i + 1) / n > self.end)


def control_rows(state_extras: dict[str, Any]) -> list[ControlRow | None] | None:
    """The batch's per-row ControlNet conditioning, or None when no row has one."""
    return state_extras.get(EXTRAS_KEY)


def merge_rows(extras: Sequence[dict[str, Any]], counts: Sequence[int]) -> list[ControlRow | None] | None:
    """The per-row conditioning of several requests' states stepped together (continuous batching), in order;
    `counts` are their row counts. None when none of them has a ControlNet row."""
    if not any(EXTRAS_KEY in e for e in extras):
        return None
    rows: list[ControlRow | None] = []
    for e, n in zip(extras, counts, strict=True):
        rows.extend(e.get(EXTRAS_KEY) or [None] * n)
    return rows


def active_groups(
    rows: Sequence[ControlRow | None], timestep: torch.Tensor
) -> dict[str, tuple[LoadedControlNet, list[int], list[float]]]:
    """ControlNet name -> (its model, the rows it runs on this call, their scale x keep): rows outside their step
    window are left out (their residual would be 0 x ..., as diffusers adds)."""
    groups: dict[str, tuple[LoadedControlNet, list[int], list[float]]] = {}
    for i, row in enumerate(rows):
        if row is None:
            continue
        keep = row.keep(timestep[i])
        if keep == 0.0:
            continue
        entry = groups.setdefault(row.controlnet.name, (row.controlnet, [], []))
        entry[1].append(i)
        entry[2].append(row.scale * keep)
    return groups


def per_block(samples: Sequence[torch.Tensor] | None, num_blocks: int, repeat: bool) -> list[torch.Tensor] | None:
    """A ControlNet's residuals mapped onto the DiT's `num_blocks` blocks as the diffusers DiT maps them (every
    `ceil(num_blocks / len)`-th block, or round-robin for `repeat`), so residuals of ControlNets of different depths
    can be summed block by block. References, not copies."""
    if not samples:
        return None
    interval = -(-num_blocks // len(samples))
    return [samples[b % len(samples)] if repeat else samples[b // interval] for b in range(num_blocks)]


def scatter(samples: Sequence[torch.Tensor] | None, rows: list[int], total: int) -> list[torch.Tensor] | None:
    """Residuals of `rows` placed in a zero tensor of `total` rows (each distinct tensor once)."""
    if not samples:
        return None
    index = torch.tensor(rows, device=samples[0].device)
    out = []
    for s in samples:
        full = s.new_zeros((total, *s.shape[1:]))
        out.append(full.index_copy(0, index, s))
    return out


def add_blocks(acc: list[torch.Tensor] | None, more: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    if more is None:
        return acc
    if acc is None:
        return list(more)
    return [a + b for a, b in zip(acc, more, strict=True)]


def step_residuals(
    state_extras: dict[str, Any],
    latents: torch.Tensor,
    timestep: torch.Tensor,
    compute: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]],
) -> dict[str, Any]:
    """The DiT's ControlNet keyword arguments for this call: `compute(latents, timestep)` on the conditional rows,
    reused by the second CFG branch of the same step (same latents object), tiled when CFG runs as one doubled
    batch (the ControlNet sees the positive prompt only, as in diffusers)."""
    rows = control_rows(state_extras)
    if rows is None:
        return {}
    cached = state_extras.get("_control_step")
    if cached is not None and cached[0] is latents and cached[1] is timestep:
        return cached[2]
    count = len(rows)
    doubled = latents.shape[0] == 2 * count
    kwargs = compute(latents[:count], timestep[:count])
    if doubled:
        kwargs = {k: [torch.cat([t, t]) for t in v] if isinstance(v, list) else v for k, v in kwargs.items()}
    state_extras["_control_step"] = (latents, timestep, kwargs)
    return kwargs


# -- set-up and request checks --------------------------------------------------------------------------------


def requested_net(params: SamplingParams, controlnets: dict[str, LoadedControlNet]) -> LoadedControlNet:
    """The ControlNet a request's rows use (its `controlnet` name, or the only one loaded)."""
    assert params.control is not None
    return controlnets[control_name(params, controlnets)]
