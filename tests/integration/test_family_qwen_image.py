"""Qwen-Image and Qwen-Image 2.1 facts beyond the conformance suite (test_family_conformance.py: diffusers
parity, merged rows with and without true CFG, continuous joins, residency and layer specs, the RoPE size
limits, usage and the server).

Tolerance: native vs the diffusers pipeline on the same loaded modules: exact (0/255).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff
from tests.integration.family_conformance import QWEN_LONG
from tests.integration.family_references import qwen_on_same_modules

pytestmark = pytest.mark.timeout(300)

TINY = {"qwen_image": "qwen-image", "qwen_image_21": "qwen-image-2.1"}
"""family -> make-tiny name."""


@pytest.fixture(scope="module")
def pipes(tiny_checkpoint, family_pipeline) -> dict[str, object]:
    return {family: family_pipeline(tiny_checkpoint(name)) for family, name in TINY.items()}


def _params(**kw) -> SamplingParams:
    base = {"width": 64, "height": 64, "num_inference_steps": 2, "seed": 7}
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("family", list(TINY))
def test_tiny_checkpoint_loads_in_diffusers(family, tiny_checkpoint, diffusers_pipeline) -> None:
    pipe = diffusers_pipeline("DiffusionPipeline", tiny_checkpoint(TINY[family]))
    assert type(pipe).__name__ == {"qwen_image": "QwenImagePipeline", "qwen_image_21": "QwenImage21Pipeline"}[family]
    if family == "qwen_image":
        # The tiny vocabulary tokenizes the template's system prefix into exactly the tokens diffusers drops.
        prefix = pipe.prompt_template_encode.split("{}")[0]
        assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx


def test_qwen_image_21_refuses_a_prompt_longer_than_its_text_positions(pipes) -> None:
    pipe = pipes["qwen_image_21"]
    pipe.validate(_params(prompt="\u00e9" * 3000))  # 6000 byte tokens in the tiny vocabulary: fits
    for field in ("prompt", "negative_prompt"):
        with pytest.raises(InvalidRequestError) as info:
            pipe.validate(_params(**{"prompt": "x", field: "\u00e9" * 5000}))  # 10000 tokens
        assert info.value.param == field
    # The front end refuses the same through the description alone (its own counter, from the tokenizer folder).
    from diffuserve.pipelines.prompt_limits import with_counter
    from diffuserve.sampling import build_sampling_params

    with pytest.raises(InvalidRequestError) as info:
        build_sampling_params(with_counter(pipe.describe_model()), prompt="\u00e9" * 5000)
    assert info.value.param == "prompt" and "positions at most" in info.value.message


def test_rope_limits_follow_the_tables(pipes) -> None:
    """The limits come from the transformers' RoPE tables: Qwen-Image's text starts max(h, w) // 2 positions
    in, so the last image side leaves exactly the 512 text positions; 2.1 centres rows on its negative table."""
    from diffuserve.family_spec.qwen_image import QWEN_IMAGE_21_ROPE_POSITIONS, QWEN_IMAGE_ROPE_POSITIONS

    qi, q21 = pipes["qwen_image"].adapter.transformer.pos_embed, pipes["qwen_image_21"].adapter.transformer.pos_embed
    # The spec's table sizes (torch-free, for both backends) are diffusers' own.
    assert qi.pos_freqs.shape[0] == qi.neg_freqs.shape[0] == QWEN_IMAGE_ROPE_POSITIONS
    assert all(f.shape[0] == sum(QWEN_IMAGE_21_ROPE_POSITIONS) for f in q21.freqs)
    tokens = pipes["qwen_image"].max_width // 16
    _, txt = qi(video_fhw=[(1, tokens, 2)], max_txt_seq_len=512, device=torch.device("cpu"))
    assert txt.shape[0] == 512
    _, txt = qi(video_fhw=[(1, tokens + 2, 2)], max_txt_seq_len=512, device=torch.device("cpu"))
    assert txt.shape[0] < 512  # one row more and the text would index past the table
    side = pipes["qwen_image_21"].max_width // 16
    neg = side - side // 2
    for axis, dim in enumerate(q21.axes_dim):
        expected = q21.rope_params(torch.tensor([-neg]), dim, q21.theta)[0]
        assert torch.equal(q21.freqs[axis][-neg], expected)  # the most negative row is still the negative table's


def test_turbo_grid_from_model_index_matches_diffusers(tiny_checkpoint, tmp_path) -> None:
    """A 2.1 checkpoint with `sample_sigmas` in model_index.json (Turbo) samples on that grid, which fixes the
    step count: the default follows it, another count is a 400, and the output equals diffusers'."""
    from diffuserve.models.loader import load_pipeline

    folder = shutil.copytree(tiny_checkpoint("qwen-image-2.1"), tmp_path / "turbo")
    index = json.loads((folder / "model_index.json").read_text())
    index["sample_sigmas"] = [1.0, 0.7, 0.4]
    index.pop("_diffuserve_defaults")  # a tiny model's suggested 4 steps would otherwise win
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(folder)
    assert pipe.defaults.num_inference_steps == 3
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(_params(prompt="x", num_inference_steps=4))
    assert info.value.param == "num_inference_steps"
    got = pipe.run([_params(prompt=QWEN_LONG, num_inference_steps=3)]).outputs[0].images
    reference = qwen_on_same_modules(pipe)
    reference.register_to_config(sample_sigmas=index["sample_sigmas"])
    want = reference(prompt=QWEN_LONG, height=64, width=64, generator=torch.Generator().manual_seed(7)).images
    assert max_pixel_diff(got[:1], want[:1]) == 0 and np.asarray(got[0]).shape == np.asarray(want[0]).shape
