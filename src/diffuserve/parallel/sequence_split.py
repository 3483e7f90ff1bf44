"""The token split of one sequence-parallel transformer call (`parallel/sequence.py`), and where it lives while
the transformer runs: in the row context of the denoiser call (`runtime/row_context.py`: `split`, and
`split_attention` while one of its joint self-attention modules runs), entered and left by the hooks on the
transformer and its attention modules.

These are read and set outside compiled code (`torch.compiler.disable`: a graph break at each hook), so the
sharded attention and its collectives stay out of the compiled blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diffuserve.runtime import row_context


@dataclass
class SplitCall:
    """The token split of one transformer call."""

    sp: Any
    """The `parallel/sequence.SequenceParallel` that split it (its groups, degrees and this rank's index)."""
    tokens: int
    """Image tokens of the call (before padding)."""
    local: int
    """Tokens per rank (after padding to a multiple of the SP degree)."""
    outer: Any = None
    """The row context before the transformer was entered (put back when it returns)."""

    @property
    def padded(self) -> int:
        return self.local * self.sp.degree

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous share of `x` along `dim` (zero-padded at the end to the padded length)."""
        if x.shape[dim] != self.tokens:
            raise ValueError(f"sequence parallel: expected {self.tokens} tokens on dim {dim}, got {tuple(x.shape)}")
        if self.padded > self.tokens:
            shape = list(x.shape)
            shape[dim] = self.padded - self.tokens
            x = torch.cat([x, x.new_zeros(shape)], dim=dim)
        return x.narrow(dim, self.sp.index * self.local, self.local).contiguous()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, local, ...) shares of every rank -> (batch, tokens, ...), the same bytes on every rank."""
        sp = self.sp
        for group, degree in ((sp.ulysses_group, sp.ulysses_degree), (sp.ring_group, sp.ring_degree)):
            if degree > 1:
                parts = [torch.empty_like(x) for _ in range(degree)]
                dist.all_gather(parts, x.contiguous(), group=group)
                x = torch.cat(parts, dim=1)
        return x[:, : self.tokens]

    def gather_on(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """`gather` along the token dim `dim` (RoPE tables: (batch, tokens, D) or (batch, heads, tokens, D))."""
        return self.gather(x.movedim(dim, 1)).movedim(1, dim).contiguous()


@torch.compiler.disable
def current_split() -> SplitCall | None:
    """The split of the transformer call in progress (None: outside one)."""
    call = row_context.current()
    return None if call is None else call.split


@torch.compiler.disable
def attention_split() -> SplitCall | None:
    """The split while one of its joint self-attention modules runs (None: anywhere else)."""
    call = row_context.current()
    return call.split if call is not None and call.split_attention else None


@torch.compiler.disable
def enter_split(split: SplitCall) -> None:
    """The transformer is entered: `split` joins the call in progress (a new call when there is none)."""
    before = row_context.current()
    split.outer = before
    row_context.swap(
        dataclasses.replace(before, split=split) if before is not None else row_context.DenoiseCall(split=split)
    )


@torch.compiler.disable
def leave_split() -> None:
    """The transformer returns (or raised): the call in progress goes back to what it was before `enter_split`."""
    split = current_split()
    if split is not None:
        row_context.swap(split.outer)


@torch.compiler.disable
def enter_attention(module: torch.nn.Module, args: tuple) -> None:
    call = row_context.current()
    if call is not None and call.split is not None:
        row_context.swap(dataclasses.replace(call, split_attention=True))


@torch.compiler.disable
def leave_attention(module: torch.nn.Module, args: tuple, output: Any) -> None:
    call = row_context.current()
    if call is not None and call.split_attention:
        row_context.swap(dataclasses.replace(call, split_attention=False))
