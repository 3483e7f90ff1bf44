"""The token budget of a batch (`--batching-max-tokens`): what one row costs, the default, and the start-up check.

A row's cost is its latent tokens: `(width / token side) x (height / token side)`, times the latent frames of a
video (the token side is the family's VAE factor x patch, `family_spec.base.LatentGeometry.size_multiple`). A batch's
tokens are the sum over its rows; the schedulers fill a batch up to the budget and up to `--batching-max-size` rows
(engine/scheduler.py rule 4, engine/step_scheduler.py rule 4).

**The default** (flag unset): `--batching-max-size` x the tokens of one row of the largest size the model allows
(its positional limit where the checkpoint has one, else its default size), so a batch of equal sizes is never cut
below the row cap at any size the server is set up for; capped by the tokens whose DiT activations fit in the
activation-memory budget (`diffuserve/activation.py`: the device's memory after the weights), but never below one
row of the largest size.

The engine applies the default only to a family that packs mixed sizes; for one that keeps one size per batch an
unset flag means no budget (rows only, the batching of before; `engine/token_costs.py`).

**The check**: an explicit budget below one row of the largest size exits 2 naming `--batching-max-tokens`,
`--batching-max-size` and the size. A request whose own tokens are over the budget (a larger size where the model
has no limit, or `n` rows) is never refused for it: it runs alone (scheduler rule 6).

Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diffuserve.errors import ConfigError


def row_tokens(width: int, height: int, num_frames: int = 1, *, token_side: int, frames_per_latent: int = 1) -> int:
    """Latent tokens of one output row of this size (at least 1)."""
    side = max(1, token_side)
    frames = (max(1, num_frames) - 1) // max(1, frames_per_latent) + 1
    return max(1, width // side) * max(1, height // side) * frames


def largest_size(max_width: int | None, max_height: int | None, sizes: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The largest size the model allows: its positional limit when both sides have one, else the largest (by
    area) of `sizes` (the default size and the warm-up sizes)."""
    if max_width and max_height:
        return max_width, max_height
    return max(sizes, key=lambda s: (s[0] * s[1], s))


@dataclass(frozen=True)
class TokenBudget:
    """The resolved token budget and where it came from (the start-up log, docs/batching.md)."""

    tokens: int
    """Latent tokens one batch or continuous group may hold."""
    source: str
    """`--batching-max-tokens N`, or how the default was derived."""

    def describe(self) -> str:
        return f"{self.tokens} latent tokens per batch ({self.source})"


def check_checkpoint_tokens(max_tokens: int | None, max_size: int, kind: str, checkpoint: Any) -> None:
    """The start-up check (exit 2) from a checkpoint's facts (`family_spec.checkpoint.CheckpointFacts`, read without
    weights): image families whose token side the configs give; video and meshes are checked once loaded."""
    if max_tokens is None or checkpoint is None or kind != "image" or not checkpoint.size_multiple:
        return
    defaults = checkpoint.defaults
    size = largest_size(checkpoint.max_width, checkpoint.max_height, [(defaults.width, defaults.height)])
    check_max_tokens(max_tokens, max_size, size, row_tokens(*size, token_side=checkpoint.size_multiple))


def check_max_tokens(max_tokens: int | None, max_size: int, size: tuple[int, int], one_row: int) -> None:
    """Exit-2 check: an explicit `--batching-max-tokens` below one row of the largest allowed size `size`."""
    if max_tokens is None or max_tokens >= one_row:
        return
    width, height = size
    raise ConfigError(
        f"--batching-max-tokens {max_tokens} is smaller than one request of {width}x{height} ({one_row} latent "
        f"tokens), the largest size this model allows: set --batching-max-tokens to at least {one_row} "
        f"({one_row * max_size} fills batches of --batching-max-size {max_size} rows of that size), or leave it "
        "unset for the default.",
        param="batching_max_tokens",
    )


def resolve_token_budget(
    max_tokens: int | None,
    max_size: int,
    *,
    size: tuple[int, int],
    one_row: int,
    memory_bytes: int | None = None,
    bytes_per_token: int | None = None,
) -> TokenBudget:
    """The budget: `max_tokens` when given (checked), else the default of the module docstring."""
    check_max_tokens(max_tokens, max_size, size, one_row)
    if max_tokens is not None:
        return TokenBudget(max_tokens, f"--batching-max-tokens {max_tokens}")
    tokens = max_size * one_row
    source = f"--batching-max-size {max_size} x {one_row} tokens of {size[0]}x{size[1]}"
    if memory_bytes is not None and bytes_per_token:
        fits = memory_bytes // bytes_per_token
        if fits < tokens:
            tokens = max(one_row, fits)
            source += f", capped to {tokens} by the activation-memory budget"
    return TokenBudget(tokens, source)
