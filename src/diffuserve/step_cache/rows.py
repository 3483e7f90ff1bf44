"""The per-row half of the step caches (`step_cache/hooks.py`): each row's history (`RowCache`) and the
policies that decide, row by row, whether it computes or reuses this step. No hooks here: these read numbers
the hooks measured (a first-block residual, a modulated input) and the row's own counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks.mag_cache import nearest_interp
from diffusers.hooks.taylorseer_cache import TaylorSeerState

from diffuserve.config.step_cache import StepCacheSettings


@dataclass(eq=False)
class RowCache:
    """One output row's step-cache history (one per row of a request; it travels with the row)."""

    settings: StepCacheSettings
    num_steps: int
    """Steps of the row's schedule (its last one computes when `compute_last_step`)."""
    step: int = 0
    """Steps this row has been through."""
    computed: int = 0
    reused: int = 0
    consecutive: int = 0
    """Reused steps since the row last computed."""
    last_computed: int = -1
    compute: bool = True
    """This step's decision (valid once `decided`)."""
    decided: bool = False
    accumulated: float = 0.0
    """teacache: rescaled change accumulated since the row last computed; magcache: the accumulated error."""
    mag: tuple[float, int] = (1.0, 0)
    """magcache: the accumulated magnitude ratio and the steps it spans since the row last computed."""
    ratios: list[float] = field(default_factory=list)
    """Calibration (`settings.calibrate`): the magnitude ratio of each computed step."""
    probe: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per CFG branch: the row's first-block residual (fbcache) or modulated input (teacache) at its last
    computed step."""
    residual: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    """Per CFG branch: the blocks' residual (hidden, encoder) at the row's last computed step."""
    taylor: dict[int, TaylorSeerState] = field(default_factory=dict)
    """taylorseer, per CFG branch: the row's Taylor factors of the blocks' residual."""
    denoiser: str = ""
    """The denoiser its cache belongs to (Wan2.2 switches experts mid-schedule: the new one starts afresh)."""

    def use_denoiser(self, key: str) -> None:
        """Forget what another denoiser cached: its residuals mean nothing to this one."""
        if key != self.denoiser:
            self.probe.clear()
            self.residual.clear()
            self.taylor.clear()
            self.accumulated = 0.0
            self.denoiser = key

    def must_compute(self) -> bool:
        """Whatever its measure says: warm-up, the last step, the cap on consecutive reuse, nothing cached yet."""
        s = self.settings
        return (
            self.step < s.warmup_steps
            or not self.residual
            and not self.taylor
            or (s.compute_last_step and self.step >= self.num_steps - 1)
            or (s.max_cached_steps > 0 and self.consecutive >= s.max_cached_steps)
        )

    def end_step(self) -> None:
        """Count the step and move on (called once per row per denoising step)."""
        if self.compute:
            self.computed += 1
            self.consecutive = 0
            self.last_computed = self.step
        else:
            self.reused += 1
            self.consecutive += 1
        self.step += 1
        self.decided = False
        self.compute = True


def new_row_caches(settings: StepCacheSettings | None, rows: int, num_steps: int) -> list[RowCache] | None:
    """`rows` fresh row caches for a request (None when it asked for none)."""
    if settings is None:
        return None
    return [RowCache(settings=settings, num_steps=num_steps) for _ in range(rows)]


def batch_row_caches(batch: Sequence[Any], num_steps: int) -> list[RowCache] | None:
    """One step cache per output row of a batch (`SamplingParams`), in row order (None when its requests asked for
    none: the method is in the batch signature, so they all did or none did)."""
    rows: list[RowCache] = []
    for params in batch:
        rows.extend(new_row_caches(params.step_cache, params.n, num_steps) or [])
    return rows or None


def step_counts(rows: Sequence[RowCache] | None) -> dict[str, Any] | None:
    """A request's counts for `timings`: steps its rows computed and reused (summed over its rows)."""
    if not rows:
        return None
    counts: dict[str, Any] = {
        "method": rows[0].settings.method,
        "computed_steps": sum(r.computed for r in rows),
        "reused_steps": sum(r.reused for r in rows),
    }
    if rows[0].settings.calibrate:  # the request's rows' ratios, averaged step by step
        counts["mag_ratios"] = [sum(step) / len(step) for step in zip(*(r.ratios for r in rows), strict=True)]
    return counts


def changes(call: CallRows, now: torch.Tensor) -> list[float | None]:
    """Per row of the call that still decides this step: the relative L1 change of `now[i]` against the row's
    probe (diffusers' FirstBlockCache measure, taken per row instead of over the batch); None where the row
    has no probe or has decided already. One device sync for the whole call.

    Over several ranks (`call.agreement`) every rank returns the same numbers: the full row's, taken from the
    ranks that hold it (`RankAgreement`)."""
    wanted = [
        i
        for i, (row, branch) in enumerate(zip(call.rows, call.branches, strict=True))
        if not row.decided and branch in row.probe
    ]
    out: list[float | None] = [None] * len(call.rows)
    if call.agreement is not None:
        return _agreed_changes(call, now, wanted)
    if not wanted:
        return out
    if call.lengths is None:
        current = now.index_select(0, torch.tensor(wanted, device=now.device))
        before = torch.stack([call.rows[i].probe[call.branches[i]] for i in wanted])
        change = _relative_l1(current, before)
    else:  # packed rows: each over its own real tokens (their counts differ)
        change = torch.cat(
            [_relative_l1(real_row(call, now, i)[None], call.rows[i].probe[call.branches[i]][None]) for i in wanted]
        )
    for i, value in zip(wanted, change.float().tolist(), strict=True):
        out[i] = value
    return out


def _relative_l1(current: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(1, current.dim()))
    return (current - before).abs().mean(dim=dims) / before.abs().mean(dim=dims).clamp_min(1e-12)


def real_row(call: CallRows, x: torch.Tensor, i: int, k: int | None = None) -> torch.Tensor:
    """Row `k` of `x` (default `i`), which is row `i` of the call, cut to its real tokens in a packed call."""
    row = x[i if k is None else k]
    return row if call.lengths is None else row[: call.lengths[i]]


def _agreed_changes(call: CallRows, now: torch.Tensor, wanted: list[int]) -> list[float | None]:
    """`changes` over several ranks: each rank takes the two L1 means of its share of each row (weighted by its
    share of the tokens), the agreement makes them the full row's on every rank, and every rank divides the same
    two numbers, in the dtype one process divides in. Every rank calls this at the same point of the same call,
    wanted rows or not (a collective)."""
    agreement = call.agreement
    assert agreement is not None
    # On the activations' device: the groups' backend (NCCL on GPUs) takes its own device's tensors.
    sums = torch.full((len(call.rows), 2), float("nan"), dtype=torch.float64, device=now.device)
    # Packed rows (`call.lengths`) measure one by one over their real tokens, as in one process.
    parts = [wanted] if call.lengths is None else [[i] for i in wanted]
    for part in [p for p in parts if p]:
        rows = [real_row(call, now, i) for i in part]
        current, share = agreement.local(torch.stack(rows))
        before, _ = agreement.local(torch.stack([call.rows[i].probe[call.branches[i]] for i in part]))
        dims = tuple(range(1, current.dim()))
        measured = torch.stack([(current - before).abs().mean(dim=dims), before.abs().mean(dim=dims)], dim=1)
        sums[torch.tensor(part, device=now.device)] = measured.to(torch.float64) * share if share else 0.0
    sums = agreement.agree(sums)
    change = (sums[:, 0].to(now.dtype) / sums[:, 1].to(now.dtype).clamp_min(1e-12)).float()
    return [None if value != value else value for value in change.tolist()]  # NaN: no measure for the row


def rescale(coefficients: Sequence[float], x: float) -> float:
    out = 0.0
    for c in coefficients:
        out = out * x + c
    return out


@dataclass
class RankAgreement:
    """How the ranks that run the same rows agree on each row's measure, so that they decide alike and never
    diverge (a rank that skipped the blocks another runs would deadlock its collectives).

    `parts` are the parallel strategies (`parallel/agreement.py`), each with `agree_rows(values)`; the sequence
    split also has `real_tokens(x) -> (x, share)`: this rank's unpadded share of the rows' tokens and its
    fraction of them (the weight of its means in the row's). The sums over the split run first, then the
    broadcasts from each group's first rank (CFG rank 0 holds the conditional branch, which decides for the row)."""

    parts: tuple[Any, ...]

    def local(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """`x` (rows first) cut to this rank's real tokens, and their share of each row's tokens."""
        share = 1.0
        for part in self.parts:
            if hasattr(part, "real_tokens"):
                x, fraction = part.real_tokens(x)
                share *= fraction
        return x, share

    def agree(self, values: torch.Tensor) -> torch.Tensor:
        for part in sorted(self.parts, key=lambda p: not hasattr(p, "real_tokens")):
            values = part.agree_rows(values)
        return values


@dataclass
class CallRows:
    """The rows of one denoiser call: row i of the call is `rows[i]`'s CFG branch `branches[i]`."""

    rows: list[RowCache]
    branches: list[int]
    agreement: RankAgreement | None = None
    """Set when several ranks run these rows (CFG, sequence or tensor parallel, FSDP): they agree on each
    measure; None in one process."""
    packed: Any = None
    """A packed mixed-size call's `packing.PackedRows` (its rows padded to the longest), else None."""
    lengths: list[int] | None = None
    """Packed: each row's real tokens of the blocks' hidden states (a prefix), set by the first block's hook;
    its measures and cached residuals cover those only (`step_cache/packed.py`). None: every token is real."""
    span: Any = None
    """Set by the first block's hook for the later blocks of this call (`step_cache.Span`: who computes, the states
    where the narrowed blocks start); None before the first block and after the last."""

    @property
    def method(self) -> str:
        return self.rows[0].settings.method


# -- the per-row policies --------------------------------------------------------------------------------------


def decide_fbcache(call: CallRows, first_residual: torch.Tensor) -> None:
    """Per row: reuse while the first block's residual changed less than the threshold since the row's last
    computed step (the conditional branch measures; the negative branch follows its row)."""
    measured = changes(call, first_residual)
    for i, (row, branch) in enumerate(zip(call.rows, call.branches, strict=True)):
        if not row.decided:
            change = measured[i]
            row.compute = row.must_compute() or change is None or change > row.settings.resolved_threshold
            row.decided = True
        if row.compute:
            row.probe[branch] = real_row(call, first_residual, i)


def decide_teacache(call: CallRows, modulated: torch.Tensor, coefficients: Sequence[float]) -> None:
    """Per row: accumulate the rescaled relative L1 change of the modulated input; compute when it passes the
    threshold (then start accumulating again)."""
    measured = changes(call, modulated)
    for i, (row, branch) in enumerate(zip(call.rows, call.branches, strict=True)):
        if not row.decided:
            change = measured[i]
            if change is not None:
                row.accumulated += rescale(coefficients, change)
            row.compute = row.must_compute() or change is None or row.accumulated >= row.settings.resolved_threshold
            if row.compute:
                row.accumulated = 0.0
            row.decided = True
        row.probe[branch] = real_row(call, modulated, i)


def decide_magcache(call: CallRows) -> None:
    """Per row, MagCache's rule: after the retained first steps, multiply the calibrated ratios of the steps since
    the row last computed and add up |1 - product|; reuse while that error stays under the threshold."""
    for row in call.rows:
        if row.decided:
            continue
        s = row.settings
        row.decided = True
        if s.calibrate:
            row.compute = True
            continue
        scales = nearest_interp(torch.tensor(s.mag_ratios), row.num_steps).tolist()
        if row.step < int(s.retention_ratio * row.num_steps + 0.5):
            row.compute = True
            continue
        ratio, steps = row.mag
        ratio, steps = ratio * scales[row.step], steps + 1
        row.accumulated += abs(1.0 - ratio)
        row.compute = row.must_compute() or row.accumulated > s.resolved_threshold
        row.mag = (1.0, 0) if row.compute else (ratio, steps)
        if row.compute:
            row.accumulated = 0.0


def decide_taylorseer(call: CallRows) -> None:
    """Per row: compute every `refresh_interval` steps since its last computed one, forecast between."""
    for row in call.rows:
        if not row.decided:
            interval = row.settings.refresh_interval
            row.compute = row.must_compute() or row.step - row.last_computed >= interval
            row.decided = True
