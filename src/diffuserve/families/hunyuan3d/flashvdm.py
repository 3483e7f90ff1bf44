"""FlashVDM: the turbo variants' faster hierarchical volume decode (the reference's `FlashVDMVolumeDecoding`,
hy3dgen 2.0.2, its default `mean` top-k mode), written from its algorithm:

1. A coarse grid (the octree resolution halved down to below 2 x 63, rounded so its side splits into 4 x 4 x 4
   mini-grids) is decoded mini-grid by mini-grid; each mini-grid attends only to the top-k latent tokens its
   queries (every 100th) score highest on average (k = 1024 of 3072, 256 of 512, else a third).
2. Each finer level (twice the cells) queries only the points near the previous level's surface: the cells
   whose sign differs from a neighbour's or whose |logit| < 0.95, dilated; the points are grouped into a
   6 x 6 x 6 partition of their bounding box and each group attends to its own top-k tokens (every 50th query).
   Points never queried are NaN in the result, which marching cubes treats as outside.

The final grid has `resolutions[-1] + 1` points per side (252 + 1 for octree 256), not `octree + 1`; vertices are
mapped by the requested octree resolution as the reference maps them. The reference decodes one row only; here
each row of a batch runs alone, so a batched row equals its solo decode.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.nn import functional as F

from diffuserve.families.hunyuan3d.vae import Attend

MIN_RESOLUTION = 63
"""Levels are added while the resolution halves to at least this (the reference's `min_resolution`)."""
MINI_GRID_NUM = 4
"""The coarse grid splits into this many mini-grids per side."""
QUERY_GRID_NUM = 6
"""Finer levels group their points into this many cells per side of their bounding box."""
UNSET = -10000.0
"""Logit of a point a finer level does not query (NaN in the result, as the reference leaves it)."""


def resolutions(octree_resolution: int, min_resolution: int = MIN_RESOLUTION) -> list[int]:
    """The cells per side of each level, coarse to fine (e.g. 256 -> [63, 126, 252], 128 -> [63, 126])."""
    levels = [octree_resolution] if octree_resolution < min_resolution else []
    while octree_resolution >= min_resolution:
        levels.append(octree_resolution)
        octree_resolution //= 2
    levels.reverse()
    first = round(levels[0] / MINI_GRID_NUM) * MINI_GRID_NUM - 1
    return [first * 2**i for i in range(len(levels))]


def _top_k(num_tokens: int) -> int:
    return {3072: 1024, 512: 256}.get(num_tokens, num_tokens // 3)


def _select(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stride: int) -> torch.Tensor:
    """Attention to the top-k keys that every `stride`-th query scores highest on average (per head)."""
    sim = (q[:, :, ::stride, :] @ k.transpose(-1, -2)).mean(-2)
    index = torch.topk(sim, dim=-1, k=_top_k(k.shape[-2])).indices.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1])
    return F.scaled_dot_product_attention(q, torch.gather(k, -2, index), torch.gather(v, -2, index))


def _coarse_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _select(q, k, v, 100)


def _grouped_attend(counts: list[int]) -> Attend:
    """Each group of consecutive queries (the points of one partition cell) selects its own keys."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for count in counts:
            outs.append(_select(q[:, :, start : start + count, :], k, v, 50))
            start += count
        return torch.cat(outs, dim=-2)

    return attend


def _near_surface(grid: torch.Tensor, level: float) -> torch.Tensor:
    """1 where a queried point's sign differs from one of its 6 neighbours' (borders replicated), else 0."""
    val = grid + level
    sign = torch.sign(val)
    same = torch.ones_like(val, dtype=torch.bool)
    side = val.shape[0]
    for dim in range(3):
        ahead = torch.cat((val.narrow(dim, 1, side - 1), val.narrow(dim, side - 1, 1)), dim)
        behind = torch.cat((val.narrow(dim, 0, 1), val.narrow(dim, 0, side - 1)), dim)
        for neighbour in (ahead, behind):
            neighbour = torch.where(neighbour > UNSET + 1000, neighbour, val)
            same &= torch.sign(neighbour) == sign
    return ((~same) & (val > UNSET + 1000)).to(torch.int32)


def _dilate(mask: torch.Tensor) -> torch.Tensor:
    """3x3x3 dilation of a non-negative (side, side, side) mask (only > 0 matters)."""
    return F.max_pool3d(mask[None, None].float(), 3, stride=1, padding=1)[0, 0]


def _coarse(
    decoded: torch.Tensor,
    geo_decoder: Callable[..., torch.Tensor],
    box: float,
    res: int,
    chunk: int,
    on_chunk: Callable[[], None] | None,
) -> torch.Tensor:
    """Level 0 of one row: (side, side, side) logits, mini-grid by mini-grid."""
    axis = np.linspace(-box, box, res + 1, dtype=np.float32)
    xyz = torch.from_numpy(np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), axis=-1)).to(decoded)
    n, m = MINI_GRID_NUM, (res + 1) // MINI_GRID_NUM
    xyz = xyz.view(n, m, n, m, n, m, 3).permute(0, 2, 4, 1, 3, 5, 6).reshape(-1, m**3, 3)
    per_call = max(chunk // xyz.shape[1], 1)
    parts = []
    for start in range(0, xyz.shape[0], per_call):
        if on_chunk is not None:
            on_chunk()
        queries = xyz[start : start + per_call]
        latents = decoded.expand(queries.shape[0], -1, -1)
        parts.append(geo_decoder(queries=queries, latents=latents, attend=_coarse_attend))
    logits = torch.cat(parts).reshape(n, n, n, m, m, m).permute(0, 3, 1, 4, 2, 5)
    return logits.reshape(res + 1, res + 1, res + 1)


def _refine_points(
    grid: torch.Tensor, res: int, last: bool, box: float, level: float
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The points of the next level (cells per side `res`) near the previous level's surface."""
    near = _near_surface(grid, level) + (grid.abs() < 0.95).to(torch.int32)
    if not last:
        near = _dilate(near)
    index = torch.zeros((res + 1,) * 3, dtype=grid.dtype, device=grid.device)
    cx, cy, cz = torch.where(near > 0)
    index[cx * 2, cy * 2, cz * 2] = 1
    for _ in range(2 if last else 1):
        index = _dilate(index)
    where = torch.where(index > 0)
    cell = torch.tensor([2 * box / res] * 3, dtype=torch.float32, device=grid.device)
    return where, torch.stack(where, dim=1) * cell - box


def _refine(
    decoded: torch.Tensor,
    geo_decoder: Callable[..., torch.Tensor],
    grid: torch.Tensor,
    res: int,
    last: bool,
    box: float,
    level: float,
    chunk: int,
    on_chunk: Callable[[], None] | None,
) -> torch.Tensor:
    """One finer level of one row: the logits on (res+1)^3 points, UNSET where not queried."""
    where, points = _refine_points(grid, res, last, box, level)
    low, high = points.min(dim=0).values, points.max(dim=0).values
    cells = torch.floor((points - low) / (high - low).clamp_min(1e-12) * (QUERY_GRID_NUM - 0.001)).long()
    order = (cells[..., 0] * QUERY_GRID_NUM**2 + cells[..., 1] * QUERY_GRID_NUM + cells[..., 2]).sort()
    points = points[order.indices].unsqueeze(0).contiguous()  # float32, as the reference queries
    _, counts = torch.unique(order.values, return_counts=True)
    # Consecutive partition cells up to `chunk` points per call (a cell larger than a chunk goes alone).
    groups: list[list[int]] = [[]]
    for count in counts.tolist():
        if groups[-1] and sum(groups[-1]) + count >= chunk:
            groups.append([])
        groups[-1].append(count)
    logits, start = [], 0
    for group in groups:
        if on_chunk is not None:
            on_chunk()
        total = sum(group)
        queries = points[:, start : start + total]
        logits.append(geo_decoder(queries=queries, latents=decoded, attend=_grouped_attend(group)))
        start += total
    values = torch.zeros(points.shape[1], dtype=decoded.dtype, device=decoded.device)
    values[order.indices] = torch.cat(logits, dim=1).reshape(-1)
    out = torch.full((res + 1,) * 3, UNSET, dtype=decoded.dtype, device=decoded.device)
    out[where] = values
    return out


def flashvdm_decode(
    decoded: torch.Tensor,
    geo_decoder: Callable[..., torch.Tensor],
    *,
    bounds: float,
    resolution: int,
    chunk_size: int,
    level: float = 0.0,
    min_resolution: int = MIN_RESOLUTION,
    on_chunk: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Occupancy logits (B, side, side, side) float32 with side = `resolutions(resolution)[-1] + 1`, NaN where
    a finer level queried nothing; each row decoded alone. `on_chunk` runs between decoder calls (cancel)."""
    levels = resolutions(resolution, min_resolution)
    rows = []
    for row in range(decoded.shape[0]):
        latents = decoded[row : row + 1]
        grid = _coarse(latents, geo_decoder, bounds, levels[0], chunk_size, on_chunk)
        for res in levels[1:]:
            grid = _refine(latents, geo_decoder, grid, res, res == levels[-1], bounds, level, chunk_size, on_chunk)
        rows.append(grid.float())
    volume = torch.stack(rows)
    return volume.masked_fill(volume == UNSET, float("nan"))
