"""Which size groups of a mixed-size batch share a packed denoiser call: the cost gate of `packing.run_mixed`.

A packed call runs every row at the call's longest latent length, so its padding costs what real tokens cost
wherever the device is compute-bound (CPU: the linear layers and the SDPA key mask compute the padding, then drop
it); what packing saves is the fixed cost of the calls it merges. The model, per denoiser call:

    cost = call_tokens + rows x longest row's latent tokens      (in latent tokens)

where `call_tokens` is a call's fixed cost in latent-token equivalents (`AdapterBase.packing_call_tokens`, else
`DEFAULT_CALL_TOKENS` by device). Text tokens cancel: every row carries its text in either layout. Attention's
quadratic term is left out (it only adds to the padding's cost). `plan` splits the size groups, sorted by tokens
per row, into the runs of neighbouring sizes that minimise the summed cost (exact, O(sizes^2)): one run is the whole
batch packed as before; several runs are one call each (packed where a run holds several sizes), one after the
other. A run is split off only where that is strictly cheaper, so a batch whose padding is under the calls it
saves packs whole. Opt-in: only where `packing_call_tokens` is set (`DEFAULT_CALL_TOKENS` is empty).

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_CALL_TOKENS: dict[str, float] = {}
"""A denoiser call's fixed cost in latent-token equivalents, by device type, where `packing_call_tokens` is unset;
a device not named here packs every mixed batch whole (`math.inf`, no gate). Empty: no default yet. On the 36M
checkpoint on this shared CPU the fitted fixed cost ranged from ~70 tokens (engine-level calls) to ~340 (the same
rows in process), and a gate at 64 won in the server bench but lost in process (docs/batching.md), so the gate is
opt-in; on CUDA the flex kernel skips padded blocks in attention and small calls are launch-bound (not measured)."""


def call_tokens(configured: float | None, device_type: str) -> float:
    """The fixed cost of one call: the family's / operator's setting, else the device's default, else inf (always
    pack)."""
    if configured is not None:
        return configured
    return DEFAULT_CALL_TOKENS.get(device_type, math.inf)


def plan(groups: Sequence[tuple[int, int]], per_call: float) -> list[list[int]]:
    """Runs of `groups` (each `(rows, latent tokens per row)`, one per size) to give one call each: lists of group
    indices, the cheapest split under the cost model above. `[[0, 1, ...]]` (everything in one packed call) when
    packing all is no dearer than any split, always for `per_call` = inf."""
    if len(groups) <= 1 or math.isinf(per_call):
        return [list(range(len(groups)))]
    by_tokens = sorted(range(len(groups)), key=lambda i: (groups[i][1], i))
    n = len(by_tokens)
    best = [0.0] + [math.inf] * n  # best[j]: cheapest cost of the j smallest sizes
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        rows = 0
        for i in range(j - 1, -1, -1):  # the run by_tokens[i:j], padded to its largest (by_tokens[j - 1])
            rows += groups[by_tokens[i]][0]
            cost = best[i] + per_call + rows * groups[by_tokens[j - 1]][1]
            if cost < best[j] or (cost == best[j] and i < cut[j]):  # ties: the longer run (fewer calls)
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append(sorted(by_tokens[cut[j] : j]))
        j = cut[j]
    return runs[::-1]


def padding_share(groups: Sequence[tuple[int, int]]) -> float:
    """The share of a call's latent tokens that is padding when `groups` pack into one call."""
    rows = sum(r for r, _ in groups)
    longest = max((t for _, t in groups), default=0)
    return 1 - sum(r * t for r, t in groups) / (rows * longest) if rows and longest else 0.0
