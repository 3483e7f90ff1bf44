"""Image families through the diffusers backend, beyond the conformance suite (test_family_conformance.py:
ERNIE-Image and Qwen-Image-Layered against their diffusers classes, ERNIE's merged rows and server, GLM-Image's
size grid, byte-identical rebuilds).

GLM-Image tolerances: a solo request equals `GlmImagePipeline.__call__` exactly (same AR draws: its seed; same DiT
call). A merged batch shares one AR call: its rows' prior tokens equal their solo runs' exactly (each row draws
from its own seed; a different batch only changes the left padding), and the images are then exact too
(per-request DiT).
"""

from __future__ import annotations

import pytest

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff, row_generators
from tests.integration.family_conformance import BY_ID
from tests.integration.family_references import resident_run

pytestmark = pytest.mark.timeout(300)


def test_layered_runs_alone_makes_rgba_layers_and_needs_one_input_image(tiny_checkpoint, family_pipeline) -> None:
    layered = family_pipeline(tiny_checkpoint("qwen-image-layered"))
    assert layered.layered and not layered.supports_batching
    # The suite's request (its resident run is shared): n layers of the RGBA input, each RGBA.
    params = SamplingParams(**dict(BY_ID["qwen-image-layered"].reference_params)["two-layers"])
    (images,) = resident_run(layered, [params])
    assert len(images) == 2 and {im.mode for im in images} == {"RGBA"}
    with pytest.raises(InvalidRequestError) as info:
        layered.validate(SamplingParams(prompt="no image", n=2))
    assert info.value.param == "image"


def test_glm_solo_matches_diffusers_and_merged_rows_equal_singletons(
    tiny_checkpoint, family_pipeline, diffusers_pipeline
) -> None:
    path = tiny_checkpoint("glm-image")
    glm = family_pipeline(path)
    assert glm.ar_prior and glm.supports_batching
    first = SamplingParams(prompt="a sign that says 'OPEN'", seed=4, n=2, guidance_scale=1.5, num_inference_steps=2)
    second = SamplingParams(prompt="a cat", seed=9, guidance_scale=1.5, num_inference_steps=2)
    solo = glm.run([first]).outputs[0].images
    expected = diffusers_pipeline("GlmImagePipeline", path)(
        first.prompt,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=1.5,
        num_images_per_prompt=2,
        generator=row_generators(4, 2),
    ).images
    assert len(solo) == 2 and max_pixel_diff(solo, expected) == 0

    # One AR call for both requests (its own stage time), then DiT and VAE per request: every row equals its solo run.
    result = glm.run([first, second])
    assert set(result.stage_seconds) == {"ar", "dit_vae", "total"}
    merged = result.outputs
    assert max_pixel_diff(merged[0].images, solo) == 0
    assert max_pixel_diff(merged[1].images, glm.run([second]).outputs[0].images) == 0
    assert max_pixel_diff(merged[0].images[:1], merged[1].images) > 8
