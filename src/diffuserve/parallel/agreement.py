"""How the ranks that run the same rows agree on a step cache's per-row measures (`step_cache/rows.py`).

A step cache decides per row from a number its first block measured. Over several ranks each rank measures its
own part (its CFG branch, its share of the tokens), and ranks that decided differently would diverge: worse, a
rank that skips the blocks another runs would leave the other waiting in the blocks' collectives. So each
measure goes through every strategy the pipeline runs before any rank decides (`step_cache.rank_agreement`, given
the pipeline's declared `sequence_parallel`, `cfg_parallel` and `rank_parts`):

- sequence parallel (`SequenceParallel.agree_rows`) sums each row's share-weighted L1 means over its Ulysses and
  Ring peers: the full row's means, as one process takes them (padded tokens left out);
- CFG parallel (`CfgParallel.agree_rows`) broadcasts them from CFG rank 0, whose conditional branch decides for
  the row (as in one process, where the negative branch follows);
- tensor parallel and FSDP (`FromFirstRank`, added by `pipeline.agree_over` when they shard it) broadcast them from
  the group's first rank: their ranks already hold the same activations, the broadcast makes the numbers the
  same bytes whatever the reduction order.

The collectives move one (rows, 2) float64 tensor per denoiser call of a cached batch (`fbcache`, `teacache`);
`magcache` and `taylorseer` decide from counters every rank holds alike, with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def from_first_rank(values: torch.Tensor, group: Any) -> torch.Tensor:
    """`values` of the first rank of `group` (None: the default group), on every rank of it."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(values, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return values


@dataclass
class FromFirstRank:
    """Tensor parallel, FSDP: every rank of `group` takes the measures of the group's first rank."""

    group: Any = None
    """The process group (None: the default group)."""

    def agree_rows(self, values: torch.Tensor) -> torch.Tensor:
        return from_first_rank(values, self.group)


def real_tokens(sp: Any, call: Any, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`x` (rows, tokens, ...) cut to rank `sp.index`'s unpadded tokens of the split `call`, and their fraction
    of the row's; outside a split call, or for a tensor that is not this rank's share, `x` whole (fraction 1:
    every rank then holds the whole row, and the sum scales both means alike, which leaves their ratio)."""
    if call is None or x.dim() < 2 or x.shape[1] != call.local:
        return x, 1.0
    real = max(0, min(call.local, call.tokens - sp.index * call.local))
    return x.narrow(1, 0, real), real / call.tokens


def sum_over_split(sp: Any, values: torch.Tensor) -> torch.Tensor:
    """`values` summed over `sp`'s Ulysses, then Ring peers."""
    for group, degree in ((sp.ulysses_group, sp.ulysses_degree), (sp.ring_group, sp.ring_degree)):
        if degree > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values
