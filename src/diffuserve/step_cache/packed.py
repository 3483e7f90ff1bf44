"""Step caches on packed mixed-size calls (`pipelines/packing.py`, `step_cache/hooks.py`).

A packed call pads each row's tokens to the call's longest. Two things would then differ from the row run alone,
and this module puts them back:
* what a row decides on (fbcache's first-block residual, teacache's modulated input) and what it caches (the
  blocks' residual, its Taylor factors): taken over the row's real tokens only (`real_lengths`: in every packing
  family a prefix of the blocks' hidden states), so padding, which the row alone does not have, moves no decision;
  cached cut to those tokens and padded back with zeros when reused (padding outputs are masked away), so a row's
  history also survives a continuous batch whose padded length changes between steps as rows join and leave;
* the narrowing to the rows that compute (`narrow_packed`): the per-row RoPE tables a packed call stacks
  (rows x tokens entries), the padding masks it hands the blocks (a key mask, flex's block mask, rebuilt for the
  rows) and the packed context the masked attention reads (`PackedRows.active`) are cut to those rows with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

MASK_ARGUMENTS = ("attn_mask", "attention_mask")
"""Block arguments that, as a (rows, tokens) bool tensor, say which of a row's tokens are real (Z-Image pads its
unified sequence itself and passes the mask to every layer)."""


def real_lengths(layout: Any, arguments: dict[str, Any], hidden: torch.Tensor) -> list[int]:
    """Real tokens of each row of the call (a prefix of its `hidden` states): from the block's own padding mask
    when it takes one, else from the packed layout by the stream's length (the latents alone, or [text, latents]
    with every row's text real: FLUX.2's joined stream)."""
    full, tokens = hidden.shape[:2]
    for name in MASK_ARGUMENTS:
        mask = arguments.get(name)
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == (full, tokens):
            return [int(n) for n in mask.sum(dim=1).tolist()]
    if tokens == layout.max_image:
        per_row = layout.image_tokens
    elif (
        tokens == layout.max_text + layout.max_image
        and layout.text_first
        and set(layout.text_tokens) == {layout.max_text}
    ):
        per_row = tuple(layout.max_text + n for n in layout.image_tokens)
    else:
        raise ValueError(
            f"step cache on packed rows: the blocks' {tokens} tokens are neither the call's latents "
            f"({layout.max_image}) nor [text, latents] with every row's text real; say in `packing_problem` that "
            "this family's step caches are not packed, or give its blocks a padding mask argument"
        )
    return [per_row[i % layout.rows] for i in range(full)]


def narrowed_layout(layout: Any, index: torch.Tensor) -> Any:
    """The packed layout of rows `index` of the call (a doubled CFG batch's rows repeat the layout's)."""
    rows = [i % layout.rows for i in index.tolist()]
    return dataclasses.replace(
        layout,
        text_tokens=tuple(layout.text_tokens[r] for r in rows),
        image_tokens=tuple(layout.image_tokens[r] for r in rows),
    )


def narrow_packed(
    layout: Any,
    arguments: dict[str, Any],
    index: torch.Tensor,
    full: int,
    memo: dict[str, Any],
    table_words: Sequence[str],
) -> tuple[dict[str, Any], AbstractContextManager[None]]:
    """A narrowed block's arguments on packed rows `index` (the generic narrowing already cut every (full, ...)
    tensor), and the packed context to run it in. `memo` lives as long as the call's narrowing: the narrowed
    layout and block mask are made once per call, not once per block."""
    narrowed = memo.get("layout")
    if narrowed is None:
        narrowed = memo["layout"] = narrowed_layout(layout, index)
    arguments = dict(arguments)
    for name, value in arguments.items():
        if any(word in name for word in table_words):
            arguments[name] = _row_tables(value, index, full)
        elif isinstance(value, dict):  # attention kwargs: FLUX.1 / FLUX.2 hand the padding mask in them
            arguments[name] = {k: _row_mask(v, index, full, narrowed, memo) for k, v in value.items()}
    return arguments, narrowed.active()


def _row_tables(value: Any, index: torch.Tensor, full: int) -> Any:
    """Per-row position tables stacked by rows (`packing.install_row_rotary`): rows x tokens entries -> the
    `index` rows' entries (a (rows, tokens, dim) table as well)."""
    if isinstance(value, tuple):
        return tuple(_row_tables(v, index, full) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] % full:
        return value
    rest = value.shape[1:]
    return value.reshape(full, -1, *rest).index_select(0, index.to(value.device)).reshape(-1, *rest)


def _row_mask(value: Any, index: torch.Tensor, full: int, narrowed: Any, memo: dict[str, Any]) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == full:
        return value.index_select(0, index.to(value.device))
    if type(value).__name__ == "BlockMask":  # flex's: sliced ones lose their mask function, so made anew
        if "block_mask" not in memo:
            memo["block_mask"] = narrowed.attention_mask(1, value.kv_num_blocks.device)
        return memo["block_mask"]
    return value
