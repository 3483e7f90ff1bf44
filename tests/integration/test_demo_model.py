"""The embedded demo model draws what simple prompts say: the shipped weights, through the normal loader.

Every colour x shape the model knows, over three seeds (the position cycles, so all five positions
are drawn), at 64px in 4 steps, in one batch of the native pipeline. A case agrees when the image's
dominant colour is the prompted colour and, of the shape templates at the prompted position, the
prompted shape overlaps the drawn ink most. The issue's bar is 90 % of cases.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diffuserve.demo import semantics, shapes
from diffuserve.models import tiny
from diffuserve.models.loader import load_pipeline

MIN_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    return load_pipeline(tiny.ensure_default_model(tmp_path_factory.mktemp("cache")))


def test_the_read_back_can_fail() -> None:
    # Each rendered scene reads back as itself, and not as any other colour or shape: the checks
    # below distinguish every pair the model knows.
    for scene in shapes.all_scenes():
        image = shapes.render(scene)
        assert shapes.dominant_colour(image) == scene.colour
        assert shapes.best_shape(image, scene.position)[0] == scene.shape
        assert shapes.nearest_position(image) == scene.position
    blank = np.full((shapes.SIZE, shapes.SIZE, 3), 255, dtype=np.uint8)
    assert shapes.dominant_colour(blank) is None and shapes.best_shape(blank, "center")[1] == 0.0


def test_defaults_are_64px_in_4_steps(demo) -> None:
    assert (demo.defaults.width, demo.defaults.height, demo.defaults.num_inference_steps) == (64, 64, 4)


def test_draws_the_prompted_colour_and_shape(demo) -> None:
    report = semantics.evaluate(demo, seeds=(0, 1, 2), steps=4)
    print(report.summary())
    assert len(report.cases) == len(shapes.COLOURS) * len(shapes.SHAPES) * 3
    assert report.rate("agrees") >= MIN_AGREEMENT, report.summary()


def test_shipped_checkpoint_is_small() -> None:
    total = sum(p.stat().st_size for p in Path(tiny.DEMO_CHECKPOINT).rglob("*") if p.is_file())
    assert total <= 8 * 1024 * 1024, f"the demo checkpoint is {total / 2**20:.1f} MiB"
