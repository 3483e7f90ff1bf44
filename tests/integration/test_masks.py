"""Masks (inpainting) natively: each family that inpaints equals its diffusers inpaint pipeline on the tiny
checkpoint and seed (with `strength` and `padding_mask_crop`), and rows with different masks, or none, merged in one
pipeline call each equal their request run alone. The HTTP and `generate` paths are in test_mask_api.py.

Tolerances (uint8 steps of 255 per pixel channel): native vs diffusers <= 1 (observed 0; 1 with padding_mask_crop,
whose paste-back resizes); a merged row vs its singleton run <= 1 (batched kernels may reorder float sums).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec import families_with, named_list
from diffuserve.media.masks import encode_mask, to_repaint_mask
from diffuserve.sampling import SamplingParams, build_sampling_params
from tests.integration.family_checks import max_pixel_diff, row_generators
from tests.integration.family_references import FLUX2_SEQ


def picture(width: int, height: int, seed: int) -> bytes:
    array = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def box_mask(width: int, height: int, box: tuple[int, int, int, int]) -> bytes:
    """A diffusers-convention mask (white = repaint) of one rectangle."""
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, box)
    return encode_mask(mask)


@dataclass(frozen=True)
class InpaintCase:
    """One family that inpaints, on its tiny checkpoint."""

    id: str
    tiny: str
    """`make-tiny --family` name."""
    diffusers_class: str
    """The diffusers inpaint pipeline it must equal."""
    width: int
    height: int
    call_kwargs: Callable[[Any], dict[str, Any]] = lambda pipe: {}
    """Extra arguments of the diffusers call (the tiny tokenizers' sequence length, guidance names, ...)."""
    fields: tuple[tuple[str, Any], ...] = ()
    """Extra request fields of both (guidance the family takes)."""
    crops: bool = True
    """The pipeline has `padding_mask_crop` (FluxFillPipeline has none)."""
    shifted_decode: bool = False
    """The diffusers inpaint pipeline decodes without the VAE's `shift_factor` (diffusers 0.42's SD3 inpaint; its
    text-to-image and img2img pipelines add it, as we do): compare its final latents, decoded with the shift."""
    mixes_plain: bool = True
    """An edit without a mask may share a call with masked rows (FLUX.2 Klein's is a reference edit: pure noise over
    the whole schedule, another program)."""
    merges: bool = True
    """Requests of the family share a call (Qwen-Image-Edit's never do: `supports_batching=False`)."""


def _t5_length(key: str) -> Callable[[Any], dict[str, Any]]:
    return lambda pipe: {"max_sequence_length": getattr(pipe, key).model_max_length}


CASES = [
    InpaintCase("flux", "flux", "FluxInpaintPipeline", 48, 64, _t5_length("tokenizer_2"), (("guidance_scale", 3.5),)),
    InpaintCase(
        "sd3",
        "sd3_16ch",
        "StableDiffusion3InpaintPipeline",
        64,
        48,
        _t5_length("tokenizer_3"),
        (("guidance_scale", 4.0),),
        shifted_decode=True,
    ),
    InpaintCase(
        "qwen_image",
        "qwen-image",
        "QwenImageInpaintPipeline",
        64,
        48,
        fields=(("negative_prompt", "blurry"), ("true_cfg_scale", 4.0)),
    ),
    InpaintCase(
        "flux_fill",
        "flux-fill",
        "FluxFillPipeline",
        48,
        64,
        _t5_length("tokenizer_2"),
        (("guidance_scale", 30.0),),
        crops=False,
    ),
    InpaintCase("z_image", "z-image", "ZImageInpaintPipeline", 64, 48, fields=(("guidance_scale", 0.0),), crops=False),
    # Klein's inpaint pipeline sizes the output from the image (floored to 16): the pictures are the output size.
    InpaintCase(
        "flux2_klein",
        "flux2-klein",
        "Flux2KleinInpaintPipeline",
        80,
        64,
        lambda pipe: {"max_sequence_length": FLUX2_SEQ},
        (("guidance_scale", 4.0),),
        mixes_plain=False,
    ),
    # QwenImageEditInpaintPipeline outputs the image's ~1024² size: a square picture of exactly that size.
    InpaintCase(
        "qwen_image_edit",
        "qwen-image-edit",
        "QwenImageEditInpaintPipeline",
        1024,
        1024,
        fields=(("negative_prompt", " "), ("true_cfg_scale", 4.0)),
        merges=False,
    ),
]


def _params(case: InpaintCase, **fields: Any) -> SamplingParams:
    base = {
        "prompt": "a fox in the snow",
        "width": case.width,
        "height": case.height,
        "num_inference_steps": 4,
        "seed": 3,
        "strength": 0.6,
        "image_inputs": (picture(case.width, case.height, 0),),
        **dict(case.fields),
    }
    return SamplingParams(**{**base, **fields})


def _reference(pipe: Any, case: InpaintCase, params: SamplingParams) -> list[Image.Image]:
    """The diffusers inpaint call the request stands for: same fields, one CPU generator per row."""
    image = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB")
    mask = Image.open(io.BytesIO(params.mask_input))
    final: list[torch.Tensor] = []

    def keep_latents(_pipe: Any, _i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        final[:] = [tensors["latents"]]
        return tensors

    images = pipe(
        prompt=params.prompt,
        image=image,
        mask_image=mask,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        strength=params.strength,
        num_images_per_prompt=params.n,
        generator=row_generators(params.seed, params.n),
        callback_on_step_end=keep_latents,
        **({"padding_mask_crop": params.padding_mask_crop} if case.crops else {}),
        **dict(case.fields),
        **case.call_kwargs(pipe),
    ).images
    if not case.shifted_decode:
        return images
    with torch.no_grad():  # its final latents, decoded as its text-to-image and img2img pipelines decode
        latents = final[0] / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        images = pipe.image_processor.postprocess(pipe.vae.decode(latents, return_dict=False)[0], output_type="pil")
    if params.padding_mask_crop is None:
        return images
    crop = pipe.mask_processor.get_crop_region(mask, params.width, params.height, pad=params.padding_mask_crop)
    return [pipe.image_processor.apply_overlay(mask, image, im, crop) for im in images]


@pytest.fixture(params=CASES, ids=lambda case: case.id)
def case(request) -> InpaintCase:
    return request.param


def _native(case: InpaintCase, tiny_checkpoint, family_pipeline) -> tuple[Any, Path]:
    path = tiny_checkpoint(case.tiny)
    return family_pipeline(path), path


@pytest.mark.parametrize(
    "variant",
    [
        {"n": 2},
        {"n": 1, "strength": 1.0, "seed": 5},
        {"n": 1, "padding_mask_crop": 4, "seed": 7},
    ],
    ids=["n2", "strength1", "padding_mask_crop"],
)
def test_inpaint_equals_the_diffusers_pipeline(case, variant, tiny_checkpoint, family_pipeline, diffusers_pipeline):
    if "padding_mask_crop" in variant and not case.crops:
        pytest.skip(f"{case.diffusers_class} has no padding_mask_crop (refused with a 400 naming it)")
    native, path = _native(case, tiny_checkpoint, family_pipeline)
    mask = box_mask(case.width, case.height, (8, 16, case.width - 8, case.height // 2 + 8))
    params = _params(case, mask_input=mask, **variant)
    ours = native.run([params]).outputs[0].images
    theirs = _reference(diffusers_pipeline(case.diffusers_class, path), case, params)
    assert [im.size for im in ours] == [im.size for im in theirs] == [(case.width, case.height)] * params.n
    assert max_pixel_diff(ours, theirs) <= 1


def test_rows_with_different_masks_or_none_merge(case, tiny_checkpoint, family_pipeline):
    """One call: two masks (one with padding_mask_crop), and an edit without a mask (a third mask where the family
    cannot mix them); each row equals its solo run, and the masks really changed the rows."""
    if not case.merges:
        pytest.skip(f"{case.id} requests never share a call (n rows of one edit are the diffusers comparison's n2)")
    native, _ = _native(case, tiny_checkpoint, family_pipeline)
    w, h = case.width, case.height
    batch = [
        _params(case, prompt="a fox", seed=1, n=2, mask_input=box_mask(w, h, (0, 0, w // 2, h))),
        _params(
            case,
            prompt="a cat",
            seed=2,
            mask_input=box_mask(w, h, (8, 8, 24, 24)),
            padding_mask_crop=2 if case.crops else None,
        ),
        _params(
            case,
            prompt="a fox",
            seed=1,
            n=2,
            image_inputs=(picture(w, h, 1),),
            mask_input=None if case.mixes_plain else box_mask(w, h, (w // 2, 0, w, h)),
        ),
    ]
    merged = [out.images for out in native.run(batch).outputs]
    for params, rows in zip(batch, merged, strict=True):
        alone = native.run([params]).outputs[0].images
        assert max_pixel_diff(rows, alone) <= 1
    # Same prompt and seed, another mask and image: the rows really differ.
    assert max_pixel_diff(merged[0][:1], merged[2][:1]) > 8


def test_a_mask_without_alpha_is_read_by_luminance_and_an_alpha_mask_by_transparency():
    rgba = Image.new("RGBA", (4, 2), (255, 255, 255, 255))
    rgba.putpixel((1, 0), (255, 255, 255, 0))  # transparent: repaint, whatever its colour
    rgba.putpixel((2, 0), (0, 0, 0, 128))  # half transparent: kept
    assert np.asarray(to_repaint_mask(rgba)).tolist() == [[0, 255, 0, 0], [0, 0, 0, 0]]
    gray = Image.new("RGB", (2, 1), (0, 0, 0))
    gray.putpixel((1, 0), (255, 255, 255))
    assert np.asarray(to_repaint_mask(gray)).tolist() == [[0, 255]]


def test_sd3_edit_without_mask_equals_its_img2img_pipeline(tiny_checkpoint, family_pipeline, diffusers_pipeline):
    """SD3 edits without a mask equal StableDiffusion3Img2ImgPipeline (n=1: with one image and n > 1 its per-row
    encode slices image rows that do not exist and fails; our rows then start as its inpaint pipeline's do)."""
    case = CASES[1]
    native, path = _native(case, tiny_checkpoint, family_pipeline)
    params = _params(case, n=1)
    pipe = diffusers_pipeline("StableDiffusion3Img2ImgPipeline", path)
    theirs = pipe(
        prompt=params.prompt,
        image=Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB"),
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        strength=params.strength,
        num_images_per_prompt=params.n,
        generator=row_generators(params.seed, params.n),
        guidance_scale=params.guidance_scale,
        **case.call_kwargs(pipe),
    ).images
    assert max_pixel_diff(native.run([params]).outputs[0].images, theirs) <= 1


def test_families_without_inpainting_refuse_a_mask_naming_those_that_take_it(tiny_checkpoint, family_pipeline):
    """A 400 naming `mask` (before queueing: the one builder runs the model's checks) that lists the families whose
    spec has the `inpaint` task; the edit route and `generate --mask-path` raise the same refusal."""
    native = family_pipeline(tiny_checkpoint("sana"))
    with pytest.raises(InvalidRequestError) as err:
        build_sampling_params(native.describe_model(), prompt="x", mask_input=box_mask(32, 32, (0, 0, 8, 8)))
    assert err.value.param == "mask"
    assert families_with("inpaints") == [
        "flux",
        "flux2_klein",
        "flux_fill",
        "qwen_image",
        "qwen_image_edit",
        "sd3",
        "z_image",
    ]
    assert named_list(families_with("inpaints")) in err.value.message, err.value.message


def test_qwen_image_takes_an_image_only_with_a_mask(tiny_checkpoint, family_pipeline):
    native = family_pipeline(tiny_checkpoint("qwen-image"))
    with pytest.raises(InvalidRequestError) as err:
        build_sampling_params(native.describe_model(), prompt="x", image_inputs=(picture(64, 48, 0),))
    assert err.value.param == "mask"


def test_flux2_klein_further_images_are_its_image_reference(tiny_checkpoint, family_pipeline, diffusers_pipeline):
    """Klein: the first image is repainted, a second one is Flux2KleinInpaintPipeline's `image_reference` (reference
    tokens after the image's own, time id 20); equal to that call (<= 1/255; observed 0)."""
    case = next(c for c in CASES if c.id == "flux2_klein")
    native, path = _native(case, tiny_checkpoint, family_pipeline)
    w, h = case.width, case.height
    mask = box_mask(w, h, (8, 16, w - 8, h // 2 + 8))
    params = _params(case, mask_input=mask, image_inputs=(picture(w, h, 0), picture(64, 64, 9)))
    theirs = diffusers_pipeline(case.diffusers_class, path)(
        prompt=params.prompt,
        image=Image.open(io.BytesIO(params.image_inputs[0])).convert("RGB"),
        image_reference=Image.open(io.BytesIO(params.image_inputs[1])).convert("RGB"),
        mask_image=Image.open(io.BytesIO(mask)),
        num_inference_steps=params.num_inference_steps,
        strength=params.strength,
        guidance_scale=params.guidance_scale,
        generator=row_generators(params.seed, params.n),
        max_sequence_length=FLUX2_SEQ,
    ).images
    ours = native.run([params]).outputs[0].images
    assert max_pixel_diff(ours, theirs) <= 1
    without = native.run([_params(case, mask_input=mask)]).outputs[0].images
    assert max_pixel_diff(ours, without) > 0  # the reference really reached the model


def test_qwen_image_edit_masks_a_smaller_image_at_its_1024_size(tiny_checkpoint, family_pipeline, diffusers_pipeline):
    """Qwen-Image-Edit with a mask: a 64x48 image and its 64x48 mask are repainted at the image's ~1024² size,
    1184x896, the image resized to it first, as QwenImageEditInpaintPipeline does (<= 1/255); another `size` is
    refused naming it, before anything is queued. With padding_mask_crop the mask is resized as the image (diffusers
    fails pasting a mask of another size back): equal to diffusers given that resized mask."""
    case = next(c for c in CASES if c.id == "qwen_image_edit")
    native, path = _native(case, tiny_checkpoint, family_pipeline)
    mask = box_mask(64, 48, (8, 8, 40, 32))
    image = (picture(64, 48, 4),)
    with pytest.raises(InvalidRequestError) as err:
        build_sampling_params(
            native.describe_model(), prompt="x", image_inputs=image, mask_input=mask, width=1024, height=1024
        )
    assert err.value.param == "size" and "1184x896" in err.value.message
    pipe = diffusers_pipeline(case.diffusers_class, path)
    params = _params(case, width=1184, height=896, image_inputs=image, mask_input=mask, n=1)
    assert max_pixel_diff(native.run([params]).outputs[0].images, _reference(pipe, case, params)) <= 1
    cropped = _params(case, width=1184, height=896, image_inputs=image, mask_input=mask, padding_mask_crop=2, n=1)
    ours = native.run([cropped]).outputs[0].images
    resized = pipe.mask_processor.resize(Image.open(io.BytesIO(mask)).convert("L"), 896, 1184)
    theirs = _reference(pipe, case, dataclasses.replace(cropped, mask_input=encode_mask(resized)))
    assert [im.size for im in ours] == [im.size for im in theirs] == [(1184, 896)]
    assert max_pixel_diff(ours, theirs) <= 1
