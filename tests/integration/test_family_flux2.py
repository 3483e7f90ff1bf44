"""FLUX.2-dev and FLUX.2-Klein facts beyond the conformance suite (test_family_conformance.py, which checks
diffusers parity, merged rows, continuous joins, residency, size limits, usage and the server, edits included).

Tolerances: native vs the diffusers pipeline on the SAME modules: exact (0); vs a separately loaded copy
(`from_pretrained`): <= 1/255 (safetensors alignment moves CPU kernels by <= 2e-6, STACK.md); batched CFG vs
two passes: <= 1/255.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff
from tests.integration.family_references import FLUX2_SEQ, flux2_images, flux2_on_same_modules, png

pytestmark = pytest.mark.timeout(300)

TINY = {"flux2": "flux2", "flux2_klein": "flux2-klein"}
"""family -> make-tiny name."""


@pytest.fixture(scope="module")
def natives(tiny_checkpoint, family_pipeline) -> dict:
    return {name: family_pipeline(tiny_checkpoint(tiny)) for name, tiny in TINY.items()}


@pytest.mark.parametrize("family", list(TINY))
def test_the_real_diffusers_class_loads_the_tiny_folder_and_agrees(
    family, natives, tiny_checkpoint, diffusers_pipeline
) -> None:
    cls = "Flux2KleinPipeline" if family == "flux2_klein" else "Flux2Pipeline"
    pipe = diffusers_pipeline(cls, tiny_checkpoint(TINY[family]))  # offline, a separate load: <= 1/255
    params = SamplingParams(
        prompt="a red cat",
        width=64,
        height=64,
        num_inference_steps=2,
        guidance_scale=4.0,
        seed=5,
        image_inputs=(png(),),
    )
    theirs = flux2_images(pipe, params)
    ours = natives[family].run([params]).outputs[0].images
    assert len(ours) == len(theirs) == 1 and max_pixel_diff(ours, theirs) <= 1


def test_checkpoint_facts(natives) -> None:
    dev, klein = natives["flux2"], natives["flux2_klein"]
    # Capped by the tokenizers' declaration.
    assert dev.adapter.max_sequence_length == klein.adapter.max_sequence_length == FLUX2_SEQ
    assert dev.size_multiple == klein.size_multiple == 16
    assert dev.max_width is None and dev.max_height is None  # RoPE from ids: no positional table
    assert (dev.defaults.width, dev.defaults.num_inference_steps, dev.defaults.guidance_scale) == (64, 4, 4.0)
    # Tiny Klein is Klein-Base (not distilled): CFG at guidance 4.0 by default, none at 1.0.
    assert not klein.adapter.is_distilled and klein.defaults.guidance_scale == 4.0
    assert klein.uses_cfg(SamplingParams(guidance_scale=4.0)) and not klein.uses_cfg(SamplingParams(guidance_scale=1.0))
    assert not dev.uses_cfg(SamplingParams(guidance_scale=4.0))


def test_distilled_klein_reads_model_index_and_skips_cfg(tiny_checkpoint, tmp_path: Path) -> None:
    """Klein 4B/9B are step-distilled (`is_distilled: true` in model_index.json): no CFG whatever guidance_scale."""
    from diffuserve.models.loader import load_pipeline

    folder = Path(shutil.copytree(tiny_checkpoint("flux2-klein"), tmp_path / "klein-distilled"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    native = load_pipeline(folder)
    assert native.adapter.is_distilled and native.defaults.guidance_scale == 1.0
    params = SamplingParams(prompt="a cat", width=64, height=64, num_inference_steps=2, guidance_scale=4.0, seed=3)
    assert not native.uses_cfg(params)
    ours = native.run([params]).outputs[0].images
    theirs = flux2_images(flux2_on_same_modules(native), params)
    assert max_pixel_diff(ours, theirs) == 0


def test_batched_cfg_matches_two_passes(natives) -> None:
    """Klein-Base's CFG as one doubled batch (reference tokens on every row) equals diffusers' two passes."""
    native = natives["flux2_klein"]
    params = SamplingParams(
        prompt="a red cat",
        width=64,
        height=64,
        num_inference_steps=2,
        guidance_scale=4.0,
        seed=6,
        n=2,
        image_inputs=(png(),),
    )
    two_passes = native.run([params]).outputs[0].images
    native.batched_cfg = True
    try:
        batched = native.run([params]).outputs[0].images
    finally:
        native.batched_cfg = False
    assert max_pixel_diff(batched, two_passes) <= 1


@pytest.mark.parametrize(
    ("fam", "fields", "param"),
    [
        ("flux2", {"negative_prompt": "blurry"}, "negative_prompt"),
        ("flux2", {"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ("flux2_klein", {"negative_prompt": "blurry", "guidance_scale": 1.0}, "negative_prompt"),
        ("flux2_klein", {"image_inputs": (png(48, 96),)}, "image"),
        ("flux2_klein", {"image_inputs": (png(64, 600),)}, "image"),
        ("flux2", {"image_inputs": (png(),) * 5}, "image"),
        # (An off-grid width, 72, is the suite's size check.)
    ],
)
def test_bad_requests_name_the_field(natives, fam: str, fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        natives[fam].validate(SamplingParams(prompt="x", **fields))
    assert info.value.param == param
