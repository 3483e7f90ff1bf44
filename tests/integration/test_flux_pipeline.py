"""Native FLUX pipeline against diffusers.FluxPipeline on the tiny checkpoint, batching fidelity, cancel.

Tolerance for every image comparison: at most 1/255 per pixel channel (one uint8 step) on the decoded
image, the issue's goal. Both pipelines run the same model classes on the same inputs, so in practice
the difference is 0; the one step leaves room for float reordering in batched kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.errors import InvalidRequestError, RequestCancelledError
from diffuserve.sampling import SamplingParams

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255


@pytest.fixture(scope="module")
def native(tiny_flux_path: Path):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(tiny_flux_path)


@pytest.fixture(scope="module")
def reference(tiny_flux_path: Path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _px(image) -> np.ndarray:
    return np.asarray(image).astype(np.int16)


def _max_diff(a, b) -> int:
    return int(np.abs(_px(a) - _px(b)).max())


def _reference_images(reference, params: SamplingParams) -> list:
    kwargs = {}
    if params.cfg_enabled:
        kwargs = {"negative_prompt": params.negative_prompt, "true_cfg_scale": params.true_cfg_scale}
    generators = [torch.Generator().manual_seed(params.seed + j) for j in range(params.n)]
    return reference(
        params.prompt,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        num_images_per_prompt=params.n,
        generator=generators if params.n > 1 else generators[0],
        max_sequence_length=reference.tokenizer_2.model_max_length,
        **kwargs,
    ).images


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(prompt="a cat surfing a wave", seed=7, guidance_scale=3.5),
        SamplingParams(prompt="red house", seed=11, width=32, height=48, num_inference_steps=3, guidance_scale=5.0),
        SamplingParams(prompt="a dog", negative_prompt="blurry", true_cfg_scale=4.0, seed=3),
        SamplingParams(prompt="sea at night", seed=5, n=2),
    ],
    ids=["plain", "non-square", "true-cfg", "n2"],
)
def test_native_matches_diffusers(native, reference, params: SamplingParams) -> None:
    ours = native.run([params]).outputs[0].images
    theirs = _reference_images(reference, params)
    assert len(ours) == len(theirs) == params.n
    for a, b in zip(ours, theirs, strict=True):
        assert a.size == (params.width, params.height)
        assert _px(a).std() > 1.0, "a flat image would make the comparison meaningless"
        assert _max_diff(a, b) <= PIXEL_TOL


def test_true_cfg_changes_the_output(native) -> None:
    # Guards the CFG test above: if CFG silently did nothing, it would still match a no-CFG reference.
    plain = native.run([SamplingParams(prompt="a dog", seed=3)]).outputs[0].images[0]
    cfg = native.run([SamplingParams(prompt="a dog", negative_prompt="blurry", true_cfg_scale=4.0, seed=3)])
    assert _max_diff(plain, cfg.outputs[0].images[0]) > 5


def test_different_prompts_and_seeds_differ(native) -> None:
    a = native.run([SamplingParams(prompt="a cat", seed=1)]).outputs[0].images[0]
    b = native.run([SamplingParams(prompt="a tree", seed=1)]).outputs[0].images[0]
    c = native.run([SamplingParams(prompt="a cat", seed=2)]).outputs[0].images[0]
    assert _max_diff(a, b) > 0
    assert _max_diff(a, c) > 5


def test_merged_batch_matches_singleton_runs(native) -> None:
    batch = [
        SamplingParams(prompt="a cat surfing", seed=1),
        SamplingParams(prompt="green forest", seed=2, n=2),
        SamplingParams(prompt="the moon over a city", seed=3),
        SamplingParams(prompt="a cat surfing", seed=4),  # a repeated prompt is encoded once
    ]
    merged = native.run(batch)
    assert [len(o.images) for o in merged.outputs] == [1, 2, 1, 1]
    for params, output in zip(batch, merged.outputs, strict=True):
        alone = native.run([params]).outputs[0].images
        for a, b in zip(output.images, alone, strict=True):
            assert _max_diff(a, b) <= PIXEL_TOL
    # The rows of the n=2 request are different images (seed + j per row).
    assert _max_diff(*merged.outputs[1].images) > 5


def test_merged_cfg_batch_and_batched_cfg_match_singletons(native) -> None:
    batch = [
        SamplingParams(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0, seed=4),
        SamplingParams(prompt="a bird", negative_prompt="ugly", true_cfg_scale=3.0, seed=5, n=2),
    ]
    alone = [native.run([p]).outputs[0].images for p in batch]
    native.batched_cfg = True
    try:
        merged = native.run(batch)
    finally:
        native.batched_cfg = False
    for output, single in zip(merged.outputs, alone, strict=True):
        for a, b in zip(output.images, single, strict=True):
            assert _max_diff(a, b) <= PIXEL_TOL


def test_stage_seconds_and_progress(native) -> None:
    steps: list[tuple[int, int]] = []
    result = native.run(
        [SamplingParams(prompt="x", seed=0, num_inference_steps=3)], on_step=lambda i, n: steps.append((i, n))
    )
    assert steps == [(0, 3), (1, 3), (2, 3)]
    assert set(result.stage_seconds) == {"encode", "latents", "denoise", "decode"}
    assert all(v >= 0 for v in result.stage_seconds.values())


def test_should_stop_cancels_after_the_current_step(native) -> None:
    steps: list[int] = []
    with pytest.raises(RequestCancelledError, match="after denoising step 2/4"):
        native.run(
            [SamplingParams(prompt="x", seed=0, num_inference_steps=4)],
            on_step=lambda i, n: steps.append(i),
            should_stop=lambda: len(steps) >= 2,
        )
    assert steps == [0, 1]
    # The pipeline is reusable after a cancellation (the scheduler state was private to that call).
    assert len(native.run([SamplingParams(prompt="x", seed=0)]).outputs[0].images) == 1


def test_validate_names_the_size_field(native) -> None:
    assert native.size_multiple == 16
    with pytest.raises(InvalidRequestError) as err:
        native.validate(SamplingParams(width=72))
    assert err.value.param == "size"
    native.validate(SamplingParams(width=32, height=96))


def test_defaults_and_components(native) -> None:
    assert (native.defaults.width, native.defaults.height) == (64, 64)
    # guidance-distilled (dev-style) tiny checkpoint: dev defaults
    assert native.defaults.num_inference_steps == 28 and native.defaults.guidance_scale == 3.5
    assert set(native.components) == {"text_encoder", "text_encoder_2", "transformer", "vae"}


def test_residency_hook_wraps_every_stage(native) -> None:
    import contextlib

    used: list[str] = []

    class Recorder:
        @contextlib.contextmanager
        def use(self, component: str):
            used.append(component)
            yield

    previous = native.residency
    native.residency = Recorder()
    try:
        native.run([SamplingParams(prompt="x", seed=0)])
    finally:
        native.residency = previous
    assert used == ["text_encoder", "text_encoder_2", "transformer", "vae"]


def test_diffusers_backend_counts_sizes_and_seeds(tiny_flux_path: Path, native) -> None:
    from diffuserve.models.loader import load_pipeline
    from diffuserve.pipelines.diffusers_backend import DiffusersBackendPipeline

    backend = load_pipeline(tiny_flux_path, backend="diffusers")
    assert isinstance(backend, DiffusersBackendPipeline)
    assert backend.size_multiple == 16
    batch = [
        SamplingParams(prompt="a cat", seed=1, width=32, height=48, n=2),
        SamplingParams(prompt="a tree", seed=9, width=32, height=48),
    ]
    steps: list[int] = []
    result = backend.run(batch, on_step=lambda i, n: steps.append(i))
    assert steps == [0, 1, 2, 3]
    assert [len(o.images) for o in result.outputs] == [2, 1]
    assert all(im.size == (32, 48) for o in result.outputs for im in o.images)
    # Same seeding convention as the native pipeline: the same images, row for row.
    ours = native.run(batch)
    for o_backend, o_native in zip(result.outputs, ours.outputs, strict=True):
        for a, b in zip(o_backend.images, o_native.images, strict=True):
            assert _max_diff(a, b) <= PIXEL_TOL
    steps.clear()
    with pytest.raises(RequestCancelledError, match="step 2/4"):
        backend.run(batch, on_step=lambda i, n: steps.append(i), should_stop=lambda: len(steps) >= 2)
    assert steps == [0, 1]


def test_sd3_runs_on_diffusers_backend(tiny_sd3_path: Path) -> None:
    from diffuserve.models.loader import load_pipeline
    from diffuserve.pipelines.diffusers_backend import DiffusersBackendPipeline

    pipe = load_pipeline(tiny_sd3_path, backend="diffusers")  # SD3 is native by default
    assert isinstance(pipe, DiffusersBackendPipeline) and pipe.family == "sd3"
    # vae factor 8 x patch 2; defaults from the pipeline itself (its __call__ and sample size)
    assert pipe.size_multiple == 16
    assert (pipe.defaults.width, pipe.defaults.guidance_scale) == (64, 7.0)
    batch = [
        SamplingParams(prompt="a cat", negative_prompt="blurry", seed=1, n=2, num_inference_steps=2),
        SamplingParams(prompt="a tree", seed=2, num_inference_steps=2),
    ]
    with pytest.raises(InvalidRequestError, match="edits"):
        pipe.validate(SamplingParams(prompt="x", image_inputs=(b"png",)))
    merged = pipe.run(batch)
    assert [len(o.images) for o in merged.outputs] == [2, 1]
    assert all(im.size == (64, 64) for o in merged.outputs for im in o.images)
    for params, output in zip(batch, merged.outputs, strict=True):
        alone = pipe.run([params]).outputs[0].images
        for a, b in zip(output.images, alone, strict=True):
            assert _max_diff(a, b) <= PIXEL_TOL


def test_batch_with_different_signatures_is_refused(native) -> None:
    with pytest.raises(ValueError, match="sampling_params.num_inference_steps"):
        native.run([SamplingParams(prompt="a", seed=1), SamplingParams(prompt="b", seed=2, num_inference_steps=3)])
