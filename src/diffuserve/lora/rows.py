"""The per-row adapter sum of one adapted layer, `y_b += sum_i scale_bi * B_i (A_i x_b)`, as few kernels as possible.

A batch's assignment (rows -> (slot, scale) pairs) is turned once into index and scale tensors (`RowPlan`), which
every adapted layer and every denoising step reuse. A layer then runs one of two paths:

- every adapted row uses the same one slot (a batch of one request, or of requests sharing an adapter): two plain
  matmuls with that slot's A and B, each row scaled by its own scale; no weight gather;
- otherwise (rows with different adapters, or several adapters per row): each adapted row's A and B are gathered
  from the stacked slots (k pairs of a row side by side along the rank, shorter rows padded with a pair of scale 0)
  and applied with two batched matmuls, the scales multiplying the rank-sized intermediate.

Rows that use no adapter are left out (not gathered, not added to), so they keep the base layer's output exactly;
when every row is adapted, nothing is gathered and the sum is added in place. A row computes the same arithmetic
alone and in a batch up to the matmul kernels' summation order (fp32: ~1e-6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowPlan:
    """How one call of `total` rows applies its adapters (built once per batch, device and dtype)."""

    rows: torch.Tensor | None
    """Indices of the rows that use any adapter; None: every row does (no gather, the sum is added in place)."""
    slots: torch.Tensor
    """(adapted rows, k) slot of each of a row's k pairs; a row with fewer pairs repeats one at scale 0."""
    scales: torch.Tensor
    """(adapted rows, 1, k * rank): each pair's scale, repeated over the rank (multiplies the A x intermediate)."""
    row_scales: torch.Tensor
    """(adapted rows,): the one scale per row when `single` is set."""
    used: frozenset[int]
    """The slots some row uses: a layer none of them adapts is skipped."""
    single: int | None
    """The one slot every adapted row uses with one pair each, else None."""


def plan_rows(
    rows: Sequence[Sequence[tuple[int, float]]], total: int, rank: int, device: torch.device, dtype: torch.dtype
) -> RowPlan | None:
    """The plan for a call of `total` rows when the batch assigned `rows` (repeated when the call doubles the
    batch, as batched CFG does); None when no row uses an adapter."""
    n = len(rows)
    if total % n:
        raise RuntimeError(f"an adapted layer got {total} rows but the batch assigned adapters to {n}")
    full = [list(rows[i % n]) for i in range(total)]
    adapted = [i for i, pairs in enumerate(full) if pairs]
    if not adapted:
        return None
    k = max(len(full[i]) for i in adapted)
    slots = [[s for s, _ in full[i]] + [full[i][0][0]] * (k - len(full[i])) for i in adapted]
    scales = [[c for _, c in full[i]] + [0.0] * (k - len(full[i])) for i in adapted]
    used = frozenset(s for i in adapted for s, _ in full[i])
    single = next(iter(used)) if k == 1 and len(used) == 1 else None
    scale_t = torch.tensor(scales, dtype=dtype, device=device)
    return RowPlan(
        rows=None if len(adapted) == total else torch.tensor(adapted, device=device),
        slots=torch.tensor(slots, device=device),
        scales=scale_t.repeat_interleave(rank, dim=1).unsqueeze(1),
        row_scales=scale_t[:, 0].contiguous(),
        used=used,
        single=single,
    )


def add_rows(
    y: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, plan: RowPlan, adapted: frozenset[int]
) -> torch.Tensor:
    """`y` (the base layer's fresh output for input `x`) plus each planned row's adapters, from the layer's
    stacked slots `down` (slots, rank, in) and `up` (slots, out, rank); in place."""
    if not plan.used & adapted:
        return y
    xa = x if plan.rows is None else x.index_select(0, plan.rows)
    if plan.single is not None:
        view = (-1,) + (1,) * (x.dim() - 1)
        part = torch.nn.functional.linear(xa, down[plan.single]) * plan.row_scales.view(view)
        delta = torch.nn.functional.linear(part, up[plan.single])
    else:
        count, k = plan.slots.shape
        a = down[plan.slots].reshape(count, -1, down.shape[-1])  # (rows, k * rank, in)
        b = up[plan.slots]  # (rows, k, out, rank)
        b = b[:, 0] if k == 1 else b.permute(0, 2, 1, 3).reshape(count, up.shape[1], -1)
        part = torch.bmm(xa.reshape(count, -1, xa.shape[-1]), a.transpose(1, 2)) * plan.scales
        delta = torch.bmm(part, b.transpose(1, 2)).reshape(*xa.shape[:-1], up.shape[1])
    if plan.rows is None:
        return y.add_(delta)
    return y.index_add_(0, plan.rows, delta)  # in place: `y` is the base layer's own fresh output


def dense_scales(
    rows: Sequence[Sequence[tuple[int, float]]], slots: int, rank: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(rows, 1, slots * rank): each row's scale for every slot, repeated over the rank (0 for a slot the row does
    not use). The fixed-shape form of a batch's assignment that compiled code reads (`add_dense`)."""
    table = torch.zeros(len(rows), slots, dtype=torch.float32)
    for i, pairs in enumerate(rows):
        for slot, scale in pairs:
            table[i, slot] += scale
    return table.repeat_interleave(rank, dim=1).unsqueeze(1).to(device, dtype)


def add_dense(
    y: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """`y` plus every row's adapters through all slots at once, for compiled code: the same shapes and the same
    graph whatever the adapters of the batch (their scales are data, `dense_scales`), so a new mix of adapters
    does not recompile. Costs the rank of every slot per token (not only of the slots the rows use)."""
    slots, rank, width = down.shape
    if scales.shape[0] != x.shape[0]:  # a doubled batch (batched CFG): the assignment repeats for each half
        scales = scales.repeat(x.shape[0] // scales.shape[0], 1, 1)
    flat_up = up.permute(1, 0, 2).reshape(up.shape[1], slots * rank)  # (out, slots * rank)
    part = torch.nn.functional.linear(x.reshape(x.shape[0], -1, width), down.reshape(slots * rank, width))
    part = part * scales.to(x.device, x.dtype)
    return y + torch.nn.functional.linear(part, flat_up).reshape(y.shape)
