"""The pure parts of packed mixed-size calls (pipelines/packing.py): grouping by size, the row masks, the padding
and the per-group scheduler step. The model-level checks (each packed row equals its singleton) are the family
conformance suite's and tests/integration/test_packed_calls.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffuserve.pipelines.batch_rows import DenoiseState
from diffuserve.pipelines.packing import (
    PackedRows,
    PackedScheduler,
    SizeGroup,
    check_mixed,
    mixed_sizes,
    pad_tokens,
    size_order,
)
from diffuserve.sampling import SamplingParams


def _params(width: int, height: int, **kw) -> SamplingParams:
    return SamplingParams(prompt="p", width=width, height=height, **kw)


def test_sizes_are_grouped_in_first_seen_order_keeping_request_order() -> None:
    batch = [_params(64, 64), _params(96, 64), _params(64, 64), _params(32, 32), _params(96, 64)]
    assert mixed_sizes(batch) and not mixed_sizes(batch[:1])
    assert size_order(batch) == [0, 2, 1, 4, 3]


def test_a_mixed_batch_must_agree_on_everything_but_the_size() -> None:
    check_mixed([_params(64, 64), _params(96, 64)])
    with pytest.raises(ValueError, match="num_inference_steps"):
        check_mixed([_params(64, 64), _params(96, 64, num_inference_steps=7)])


def test_masks_cover_each_rows_own_tokens_in_both_orders() -> None:
    rows = PackedRows(text_tokens=(3, 3), image_tokens=(2, 4), max_text=3, max_image=4)
    mask = rows.key_mask(repeats=1, device="cpu")
    assert mask.tolist() == [[True] * 3 + [True, True, False, False], [True] * 7]
    assert rows.padding_tokens == 2
    doubled = rows.key_mask(repeats=2, device="cpu")  # a doubled CFG batch: the same rows twice
    assert torch.equal(doubled, torch.cat([mask, mask]))
    image_first = dataclasses.replace(rows, text_first=False).key_mask(1, "cpu")
    assert image_first[0].tolist() == [True, True, False, False, True, True, True]
    # An attention whose text is shorter (a two-pass CFG negative branch) or absent (image-only attention).
    assert rows.sdpa_mask(batch=2, keys=4 + 5, device="cpu").shape == (2, 1, 1, 9)
    assert rows.sdpa_mask(batch=2, keys=4, device="cpu")[0, 0, 0].tolist() == [True, True, False, False]
    assert rows.sdpa_mask(batch=2, keys=3, device="cpu") is None


def test_padding_and_the_per_group_scheduler_step() -> None:
    class Halve:
        """A scheduler whose step records what it saw: each group steps its own rows at its own length."""

        def __init__(self) -> None:
            self.seen: list[tuple[int, ...]] = []

        def step(self, pred, t, latents, return_dict=False):
            self.seen.append(tuple(latents.shape))
            return (latents - pred / 2,)

    a, b = torch.ones(1, 2, 3), torch.full((2, 4, 3), 2.0)
    packed = pad_tokens([a, b], 4)
    assert packed.shape == (3, 4, 3) and packed[0, 2:].abs().sum() == 0
    groups = [
        SizeGroup([], slice(0, 1), DenoiseState(a, torch.zeros(1), Halve(), {})),
        SizeGroup([], slice(1, 3), DenoiseState(b, torch.zeros(1), Halve(), {})),
    ]
    out = PackedScheduler(groups, 4).step(torch.ones_like(packed), torch.zeros(3), packed)[0]
    assert groups[0].state.scheduler.seen == [(1, 2, 3)] and groups[1].state.scheduler.seen == [(2, 4, 3)]
    assert torch.equal(out[0, :2], a[0] - 0.5) and out[0, 2:].abs().sum() == 0 and torch.equal(out[1:], b - 0.5)


def test_image_form_latents_come_back_in_their_shape() -> None:
    latents = torch.randn(2, 4, 3, 5)  # (rows, channels, h, w)
    tokens = latents.flatten(2).transpose(1, 2)
    group = SizeGroup([], slice(0, 2), DenoiseState(tokens, torch.zeros(1), None, {}), spatial=(4, 3, 5))
    assert torch.equal(group.latents_of(pad_tokens([tokens], 20)), latents)


def test_the_cost_gate_packs_while_padding_costs_less_than_the_calls_it_saves() -> None:
    """`pack_plan.plan`: (rows, tokens per row) per size; a call costs `per_call` + rows x its longest row."""
    from diffuserve.pipelines.pack_plan import plan

    near = [(2, 16), (2, 24)]  # padding 2 x 8 = 16 tokens < one call's 64: one packed call
    assert plan(near, 64.0) == [[0, 1]]
    assert plan(near, 8.0) == [[0], [1]]  # 16 tokens of padding > 8: two calls
    # The 36m mix (64x64 96x128 128x128 128x192), given out of order: runs are neighbours in tokens per row.
    # 16 | 48+64 | 96 costs 3 x 64 + 32 + 4 x 64 + 192 = 672 tokens; one packed call 64 + 8 x 96 = 832, one call
    # per size 4 x 64 + 448 = 704, and every other split 704 or more.
    mix = [(2, 96), (2, 16), (2, 64), (2, 48)]
    assert plan(mix, 64.0) == [[1], [2, 3], [0]]
    assert plan(mix, float("inf")) == [[0, 1, 2, 3]]  # inf (no gate, the default): always one call
    assert plan([(3, 40)], 0.0) == [[0]]
