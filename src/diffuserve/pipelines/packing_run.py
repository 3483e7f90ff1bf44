"""The recipe side of packed mixed-size calls (`packing.py`): `run_mixed`, what `RecipePipeline.run_to_latents` runs
for a batch of several sizes. The opt-in cost gate (`pack_plan.py`) first splits the batch's sizes into runs of one call
each where a packed call's padding would cost more than the calls it saves; a run of several sizes runs packed,
a run of one size as any batch. Compositions not yet proven packed (`packing_problem`) run one recipe run per size.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from diffuserve.pipelines import pack_plan
from diffuserve.pipelines.batch_rows import Cond, Denoised, DenoiseState, StageTimer, gather_rows, num_rows
from diffuserve.pipelines.packing import (
    Packed,
    PackedRows,
    PackedScheduler,
    RecipePipeline,
    SizeGroup,
    _sum_seconds,
    check_mixed,
    mixed_sizes,
    pad_tokens,
    size_order,
)
from diffuserve.step_cache.rows import new_row_caches

if TYPE_CHECKING:
    from collections.abc import Sequence

    from diffuserve.sampling import SamplingParams

logger = logging.getLogger(__name__)


def run_mixed(pipe: RecipePipeline, batch: list[SamplingParams], **callbacks: Any) -> Denoised:
    """`run_to_latents` for a batch of several sizes: one packed denoiser call per step, or one call per run of
    sizes where the cost gate (`pack_plan.py`) finds padding dearer than the calls it saves, or (for a composition
    `packing_problem` names) one recipe run per size group."""
    order = size_order(batch)
    ordered = [batch[i] for i in order]
    head = check_mixed(ordered)
    problem = pipe.packing_problem(head, ordered)
    sizes = _by_size_index(batch)
    if problem is not None:
        logger.info("mixed sizes run as separate size-group calls: %s", problem)
        return _run_parts(pipe, batch, sizes, callbacks)
    side = max(1, pipe.size_multiple)
    tokens = [(p.width // side) * (p.height // side) * max(1, p.num_frames or 1) for p in (batch[g[0]] for g in sizes)]
    groups = [(sum(batch[i].n for i in g), t) for g, t in zip(sizes, tokens, strict=True)]
    runs = pack_plan.plan(
        groups, pack_plan.call_tokens(pipe.adapter.packing_call_tokens, torch.device(pipe.device).type)
    )
    if len(runs) > 1:
        logger.debug(
            "mixed sizes run as %d calls (padding %.0f%% of one packed call)",
            len(runs),
            100 * pack_plan.padding_share(groups),
        )
        return _run_parts(pipe, batch, [[i for k in run for i in sizes[k]] for run in runs], callbacks)
    return _run_packed(pipe, batch, callbacks)


def _run_parts(
    pipe: RecipePipeline, batch: list[SamplingParams], parts: list[list[int]], callbacks: dict[str, Any]
) -> Denoised:
    """The parts (request indices into `batch`) as separate runs, one after the other: each a plain recipe run, or
    a packed one where it holds several sizes. No previews: each part's would name only its own requests."""
    callbacks = {**callbacks, "on_preview": None}
    runs = []
    for part in parts:
        rows = [batch[i] for i in part]
        runs.append(_run_packed(pipe, rows, callbacks) if mixed_sizes(rows) else pipe.run_to_latents(rows, **callbacks))
    order = [i for part in parts for i in part]
    state = DenoiseState(latents=torch.empty(0), timesteps=torch.empty(0), scheduler=None, extras={})
    state.extras["packed"] = Packed([], PackedRows((), (), 0, 0), order, extras={"parts": runs})
    stage_seconds = _sum_seconds([run.stage_seconds for run in runs])
    return Denoised([batch[i] for i in order], state.latents, state, stage_seconds)


def _run_packed(pipe: RecipePipeline, batch: list[SamplingParams], callbacks: dict[str, Any]) -> Denoised:
    """Every row of `batch` (several sizes) in one packed denoiser call per step."""
    order = size_order(batch)
    ordered = [batch[i] for i in order]
    head = ordered[0]
    cfg = pipe.uses_cfg(head)
    timer = StageTimer()
    with torch.inference_mode():
        with timer.stage("encode"):
            positive, negative = pipe.encode_batch(ordered, cfg)
        with timer.stage("latents"), contextlib.ExitStack() as scope:
            for key in pipe.prepare_components(head):
                scope.enter_context(pipe.component_scope(key))
            groups = _prepare_groups(pipe, ordered, positive)
        layout = pipe.packed_layout(groups, positive)
        state = _packed_state(pipe, groups, layout, order, positive)
        steps = len(state.timesteps)  # each row's step cache (step_cache/hooks.py), none when asked for none
        rows = [c for p in ordered for c in new_row_caches(p.step_cache, p.n, steps) or []] or None
        with timer.stage("denoise"), pipe.lora_scope(ordered):
            latents = pipe._denoise(
                state,
                positive,
                negative,
                head,
                callbacks.get("on_step"),
                callbacks.get("should_stop"),
                _in_request_order(callbacks.get("on_preview"), order),
                ordered,
                rows,
            )
    return Denoised(batch=ordered, latents=latents, state=state, stage_seconds=timer.seconds, row_caches=rows)


def _in_request_order(on_preview: Any, order: list[int]) -> Any:
    """The preview callback, handed previews per request in the batch's order as given (the packed call's order
    groups the requests by size)."""
    if on_preview is None:
        return None

    def restore(per_request: list[Any]) -> list[Any]:
        restored: list[Any] = [None] * len(per_request)
        for k, index in enumerate(order):
            restored[index] = per_request[k]
        return restored

    return lambda step, steps, make: on_preview(step, steps, lambda: restore(make()))


def _by_size_index(batch: Sequence[SamplingParams]) -> list[list[int]]:
    """Request indices by size, the sizes in first-seen order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, params in enumerate(batch):
        groups.setdefault((params.width, params.height), []).append(i)
    return list(groups.values())


def _prepare_groups(pipe: RecipePipeline, ordered: list[SamplingParams], positive: Cond) -> list[SizeGroup]:
    groups, start = [], 0
    for group in ([ordered[i] for i in g] for g in _by_size_index(ordered)):
        rows = slice(start, start + num_rows(group))
        cond = gather_rows(positive, torch.arange(rows.start, rows.stop), pipe.adapter.masked_sequences)
        state = pipe.prepare(group, group[0], cond)
        spatial = tuple(state.latents.shape[1:]) if state.latents.ndim == 4 else None
        if spatial is not None:
            state.latents = state.latents.flatten(2).transpose(1, 2)
        groups.append(SizeGroup(batch=group, rows=rows, state=state, spatial=spatial))
        start = rows.stop
    lengths = {len(g.state.timesteps) for g in groups}
    if len(lengths) > 1:
        raise ValueError(f"packed size groups run different step counts {sorted(lengths)}; they cannot share calls")
    return groups


def _packed_state(
    pipe: RecipePipeline, groups: list[SizeGroup], layout: PackedRows, order: list[int], positive: Cond
) -> DenoiseState:
    length = max(g.tokens for g in groups)
    latents = pad_tokens([g.state.latents for g in groups], length)
    # Per-row timesteps: (steps, rows), each row on its own size group's schedule (dynamic shift differs by size).
    timesteps = torch.cat([g.state.timesteps[:, None].expand(-1, g.rows.stop - g.rows.start) for g in groups], dim=1)
    packed = Packed(groups=groups, layout=layout, order=order)
    extras = {"packed": packed, **pipe.packed_extras(groups, layout, positive)}
    return DenoiseState(latents=latents, timesteps=timesteps, scheduler=PackedScheduler(groups, length), extras=extras)
