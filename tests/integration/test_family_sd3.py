"""SD3 / SD3.5 facts beyond the conformance suite (test_family_conformance.py: parity with a separately loaded
diffusers pipeline (<= 1/255), merged rows, continuous joins, residency, the positional-table size limit over
the server and in-process, usage and the server).

Tolerances: against diffusers, 0 (identical pixels) when both run the very same weight tensors (`twin`), and one
uint8 step (1/255) when each loads the folder itself (safetensors-loaded weights may sit at unaligned
addresses, so CPU kernels differ by ~1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff
from tests.integration.family_conformance import BY_ID
from tests.integration.family_references import sd3_images

pytestmark = pytest.mark.timeout(300)

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255


@pytest.fixture(scope="module")
def native(tiny_sd3_path: Path, family_pipeline):
    return family_pipeline(tiny_sd3_path)  # backend auto: native for SD3


@pytest.fixture(scope="module")
def reference(tiny_sd3_path: Path, diffusers_pipeline):
    return diffusers_pipeline("StableDiffusion3Pipeline", tiny_sd3_path)


@pytest.fixture(scope="module")
def twin(reference):
    """The native adapter over the diffusers pipeline's own modules (the very same weight tensors)."""
    from diffuserve.families.sd3.adapter import SD3Adapter
    from diffuserve.pipelines.recipe import RecipePipeline

    return RecipePipeline(SD3Adapter.from_components(dict(reference.components), device="cpu", dtype=torch.float32))


def test_the_real_diffusers_class_loads_the_tiny_folder(reference) -> None:
    # (Byte-identical rebuild and size: the suite.) The declared positional table: 32 patches of 2 x 8 px.
    assert reference.transformer.config.pos_embed_max_size == 32


def test_defaults_and_limits_come_from_the_checkpoint(native, reference) -> None:
    import inspect

    # diffusers' call defaults: transformer sample size x VAE factor (64 px here), 28 steps, guidance 7.0.
    call = inspect.signature(type(reference).__call__).parameters
    d = native.defaults
    assert (d.width, d.height) == (reference.default_sample_size * reference.vae_scale_factor,) * 2 == (64, 64)
    assert (
        (d.num_inference_steps, d.guidance_scale)
        == (call["num_inference_steps"].default, call["guidance_scale"].default)
        == (28, 7.0)
    )
    # The table's 512 px: the suite checks 512 runs and 528 is refused naming `size` and the table.
    assert native.max_width == native.max_height == reference.transformer.config.pos_embed_max_size * 2 * 8


@pytest.mark.parametrize("variant", [name for name, _ in BY_ID["sd3"].reference_params])
def test_native_on_the_same_tensors_matches_diffusers_exactly(twin, reference, variant: str) -> None:
    params = SamplingParams(**dict(BY_ID["sd3"].reference_params)[variant])
    theirs = sd3_images(reference, params)
    same_weights = twin.run([params]).outputs[0].images
    assert len(same_weights) == len(theirs) == params.n
    assert all(a.size == (params.width, params.height) for a in same_weights)
    assert max_pixel_diff(same_weights, theirs) == 0


def test_checkpoint_saved_without_t5_matches_diffusers(reference, tmp_path: Path) -> None:
    """diffusers lets SD3 drop T5 (its tokens become zeros); such a folder loads and runs natively."""
    from diffusers import StableDiffusion3Pipeline

    from diffuserve.models.loader import load_pipeline

    without = StableDiffusion3Pipeline(**{**reference.components, "text_encoder_3": None, "tokenizer_3": None})
    without.set_progress_bar_config(disable=True)
    without.save_pretrained(tmp_path / "no-t5")
    loaded = load_pipeline(tmp_path / "no-t5")
    assert (
        loaded.adapter.text_encoders == ("text_encoder", "text_encoder_2") and "text_encoder_3" not in loaded.components
    )
    params = SamplingParams(prompt="a red fox", seed=2, num_inference_steps=2, guidance_scale=5.0)
    theirs = sd3_images(without, params)  # max_sequence_length: diffusers' 256, nothing to cap it
    assert max_pixel_diff(loaded.run([params]).outputs[0].images[:1], theirs[:1]) <= PIXEL_TOL


def test_cached_empty_negative_is_a_fresh_encoding(twin) -> None:
    """CFG without a negative prompt reuses one encoding of "": it must be what a fresh call gives."""
    with torch.inference_mode():
        for key in twin.adapter.text_encoders:
            cached, fresh = twin.adapter._encode_empty(key), twin.adapter._encode_group(key, [""])
            assert cached.keys() == fresh.keys()
            assert all(torch.equal(cached[k], fresh[k]) for k in fresh)
