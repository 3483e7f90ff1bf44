"""CFG parallel: the conditional and unconditional branches of every denoising step on two ranks.

Rank `r` of the CFG group runs branch `r` (0: the positive conditioning, 1: the negative) through the
family's own `predict`, the two predictions are all-gathered, and every rank applies the family's own
`combine_guidance`. So each rank holds the same latents after every step, the arithmetic is exactly that of
sequential CFG (the same two transformer calls, the same combine), and the output is bit-identical to the
single-process run. Families that must run CFG as one doubled batch to match diffusers (`batched_cfg`)
are refused: split in two, their calls would round differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diffuserve.errors import ConfigError


@dataclass
class CfgParallel:
    """The CFG-parallel strategy a `RecipePipeline` uses once `pipeline.use_cfg_parallel` gave it one."""

    group: Any = None
    """The torch.distributed process group of the two CFG ranks (None: the default group)."""

    def __post_init__(self) -> None:
        size = dist.get_world_size(self.group)
        if size != 2:
            raise ConfigError(
                f"--enable-cfg-parallel needs a CFG group of 2 ranks (one per branch); got {size}.",
                param="enable_cfg_parallel",
            )
        self.rank = dist.get_rank(self.group)

    def guided(
        self,
        predict: Callable[[Any], torch.Tensor],
        positive: Any,
        negative: Any,
        combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """This rank's branch, gathered with the other's, combined as the family combines them."""
        mine = predict(positive if self.rank == 0 else negative).contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.group)
        return combine(both[0], both[1])

    def agree_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Step caches: every rank takes CFG rank 0's per-row measures, its conditional branch deciding for the
        row as in one process (`parallel/agreement.py`)."""
        from diffuserve.parallel.agreement import from_first_rank

        return from_first_rank(values, self.group)


def enable_cfg_parallel(pipeline: Any, group: Any = None) -> CfgParallel:
    """Attach CFG parallel to a native pipeline (refusing families whose CFG must stay one doubled batch)."""
    if not pipeline.capabilities.split_over_ranks:
        raise ConfigError(
            f"--enable-cfg-parallel: the {pipeline.family} model runs on the diffusers backend, whose "
            "denoising loop cannot be split across ranks; serve a native family.",
            param="enable_cfg_parallel",
        )
    if pipeline.batched_cfg:
        raise ConfigError(
            f"--enable-cfg-parallel: {pipeline.family} runs CFG as one doubled batch to match "
            "diffusers exactly, which two ranks cannot reproduce; leave it off for this family.",
            param="enable_cfg_parallel",
        )
    strategy = CfgParallel(group)
    pipeline.use_cfg_parallel(strategy)
    return strategy
