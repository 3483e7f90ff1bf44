"""Edits of different `strength` share one pipeline call (`FamilySpec.strength_per_row`): every row runs the full
schedule of `num_inference_steps` and starts at its own step `int(steps - steps * strength)`, the rows that have not
started keeping their re-noised latents (`pipelines/inpaint.py` `row_starts`). Each row of the merged call equals its
request run alone, for every family that inpaints natively.

Tolerance (uint8 steps of 255 per pixel channel): a merged row vs its singleton run <= 1 (batched kernels may
reorder float sums).
"""

from __future__ import annotations

import dataclasses

import pytest

from diffuserve import family_spec
from diffuserve.pipelines import inpaint
from tests.integration.family_checks import max_pixel_diff
from tests.integration.test_masks import CASES, InpaintCase, _native, _params, box_mask, picture

IMG2IMG = {"flux", "sd3", "flux_fill"}
"""Families whose edits take an image without a mask (the others refuse it: their diffusers pipelines inpaint only)."""


@pytest.mark.parametrize(
    "case",
    # Families whose spec keeps one strength per batch (FLUX.2 Klein: no `strength_per_row`) are not mixed here.
    [c for c in CASES if c.merges and family_spec.spec_for(c.id).strength_per_row],
    ids=lambda case: case.id,
)
def test_rows_with_different_strengths_share_one_call(case: InpaintCase, tiny_checkpoint, family_pipeline, monkeypatch):
    native, _ = _native(case, tiny_checkpoint, family_pipeline)
    assert native.strength_per_row and native.capabilities.strength_per_row
    w, h = case.width, case.height
    plain = {} if case.id in IMG2IMG else {"mask_input": box_mask(w, h, (0, 8, w, h - 8))}
    batch = [  # 4 steps: the rows start at steps 2, 1 and 0 of the shared schedule
        _params(case, prompt="a fox", seed=1, strength=0.5, image_inputs=(picture(w, h, 1),), **plain),
        _params(case, prompt="a cat", seed=2, n=2, strength=0.75, mask_input=box_mask(w, h, (0, 0, w // 2, h))),
        _params(case, prompt="a fox", seed=1, strength=1.0, mask_input=box_mask(w, h, (8, 8, 24, 24))),
    ]
    assert inpaint.row_starts(batch) == (2, 1, 1, 0)
    seen: list[int] = []
    predict = native.predict

    def counting(latents, *args, **kwargs):  # the rows each denoiser call runs
        seen.append(latents.shape[0])
        return predict(latents, *args, **kwargs)

    monkeypatch.setattr(native, "predict", counting)
    merged = [out.images for out in native.run(batch).outputs]
    monkeypatch.undo()
    # Rows that have not started cost nothing: 1, 3, 4, 4 rows per step (each call doubled, or made twice, by CFG).
    per_step = len(seen) // 4
    rows = [sum(seen[i * per_step : (i + 1) * per_step]) for i in range(4)]
    assert [r * 4 // rows[-1] for r in rows] == [1, 3, 4, 4], seen
    for params, rows in zip(batch, merged, strict=True):
        alone = native.run([params]).outputs[0].images
        assert max_pixel_diff(rows, alone) <= 1, params.strength
    # The strength mattered: the first request at strength 1.0 differs from its own rows at 0.5.
    full = native.run([dataclasses.replace(batch[0], strength=1.0)]).outputs[0].images
    assert max_pixel_diff(merged[0], full) > 8
