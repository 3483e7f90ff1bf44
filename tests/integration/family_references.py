"""The diffusers calls the family conformance suite compares native pipelines with, the test pictures, and the
session's resident runs (family_conformance.py names, per case, which reference call applies).

Each reference call is the diffusers call a request stands for: same fields, one CPU generator per output row
seeded seed + j (a Wan2.1 text-to-video call: one generator).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import row_generators


def png(width: int = 96, height: int = 80, seed: int = 0) -> bytes:
    """A random RGB picture (an edit's reference image)."""
    array = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def two_tone_png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    """A two-tone picture: distinct inputs give visibly different edits with the tiny Qwen edit models."""
    array = np.zeros((height, width, 3), dtype=np.uint8)
    array[...] = colour
    array[: height // 2, :, 1] = 255 - colour[1]
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def rgba_png(width: int, height: int) -> bytes:
    """Two overlapping translucent rectangles (Qwen-Image-Layered's input)."""
    image = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    image.paste((220, 40, 30, 255), (8, 8, width // 2, height // 2))
    image.paste((30, 60, 200, 160), (width // 3, height // 3, width - 4, height - 4))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _rgb(params: SamplingParams) -> list[Image.Image]:
    return [Image.open(io.BytesIO(b)).convert("RGB") for b in params.image_inputs]


def _uint8_frames(frames: Any) -> list[np.ndarray]:
    return [(np.clip(f, 0, 1) * 255).round().astype("uint8") for f in frames]


@dataclass(frozen=True)
class Subject:
    """What a reference call needs: the loaded native pipeline, its folder, and the session's diffusers loader."""

    native: Any
    """The pipeline under test (`load_pipeline` of `path`)."""
    path: Path
    """The tiny checkpoint folder."""
    diffusers: Callable[[str, Path], Any]
    """`diffusers(class_name, path)` -> a cached `from_pretrained` diffusers pipeline (conftest)."""


Reference = Callable[[Subject, SamplingParams], list]
"""The diffusers call a request stands for: images, or videos (lists of uint8 frames), one per output row."""


_RUNS: dict[tuple[int, tuple[SamplingParams, ...]], list] = {}


def resident_run(native: Any, batch: list[SamplingParams]) -> list:
    """Each request's images (or videos) of `native.run(batch)`, run once per session: the resident reference
    several checks compare with (edits cost seconds per input image)."""
    key = (id(native), tuple(batch))
    if key not in _RUNS:
        _RUNS[key] = [outputs_of(native, out) for out in native.run(batch).outputs]
    return _RUNS[key]


def outputs_of(native: Any, output: Any) -> list:
    return output.videos if native.output_kind == "video" else output.images


# -- reference calls, one per diffusers pipeline class -------------------------------------------------------

FLUX2_SEQ = 64
"""Text tokens the tiny FLUX.2 checkpoints declare (the diffusers calls pass it as max_sequence_length)."""


def flux2_on_same_modules(native: Any) -> Any:
    """The diffusers pipeline of `native`'s FLUX.2 family on the very same modules (and a fresh scheduler)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    parts = dict(
        scheduler=native.adapter.scheduler.__class__.from_config(native.adapter.scheduler.config),
        vae=native.adapter.vae,
        text_encoder=native.adapter.text_encoder,
        tokenizer=native.adapter.tokenizer,
        transformer=native.adapter.transformer,
    )
    if native.family == "flux2_klein":
        pipe = Flux2KleinPipeline(**parts, is_distilled=native.adapter.is_distilled)
    else:
        pipe = Flux2Pipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux2_images(pipe: Any, params: SamplingParams) -> list[Image.Image]:
    """A FLUX.2 diffusers call: same fields, one CPU generator per row seeded seed + j."""
    return pipe(
        prompt=params.prompt,
        image=_rgb(params) or None,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        num_images_per_prompt=params.n,
        max_sequence_length=FLUX2_SEQ,
        generator=row_generators(params.seed, params.n),
    ).images


def flux2_reference(subject: Subject, params: SamplingParams) -> list:
    return flux2_images(flux2_on_same_modules(subject.native), params)


def qwen_on_same_modules(native: Any) -> Any:
    """The diffusers Qwen-Image (2.1) pipeline around the modules our loader loaded."""
    from diffusers import QwenImage21Pipeline, QwenImagePipeline

    if native.family == "qwen_image":
        return QwenImagePipeline(
            scheduler=native.adapter.scheduler,
            vae=native.adapter.vae,
            text_encoder=native.adapter.text_encoder,
            tokenizer=native.adapter.tokenizer,
            transformer=native.adapter.transformer,
        )
    return QwenImage21Pipeline(
        scheduler=native.adapter.scheduler,
        vae=native.adapter.vae,
        text_encoder=native.adapter.text_encoder,
        processor=native.adapter.processor,
        transformer=native.adapter.transformer,
    )


def qwen_reference(subject: Subject, params: SamplingParams) -> list:
    return qwen_on_same_modules(subject.native)(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        true_cfg_scale=params.true_cfg_scale,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        num_images_per_prompt=params.n,
        generator=row_generators(params.seed, params.n),
    ).images


def qwen_edit_reference(class_name: str) -> Reference:
    def call(subject: Subject, params: SamplingParams) -> list:
        images = _rgb(params)
        return subject.diffusers(class_name, subject.path)(
            image=images[0] if class_name == "QwenImageEditPipeline" else images,
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            true_cfg_scale=params.true_cfg_scale,
            width=params.width,
            height=params.height,
            num_inference_steps=params.num_inference_steps,
            num_images_per_prompt=params.n,
            generator=row_generators(params.seed, params.n),
        ).images

    return call


def sana_reference(subject: Subject, params: SamplingParams) -> list:
    """diffusers' default SANA call (complex human instruction, resolution binning on, 300 tokens)."""
    return subject.diffusers("SanaPipeline", subject.path)(
        params.prompt,
        negative_prompt=params.negative_prompt or "",
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        num_images_per_prompt=params.n,
        generator=row_generators(params.seed, params.n),
    ).images


def z_image_reference(subject: Subject, params: SamplingParams) -> list:
    kwargs = {"negative_prompt": params.negative_prompt} if params.negative_prompt else {}
    return subject.diffusers("ZImagePipeline", subject.path)(
        params.prompt,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        num_images_per_prompt=params.n,
        generator=row_generators(params.seed, params.n),
        **kwargs,
    ).images


_SD3_RUNS: dict[tuple[int, SamplingParams], tuple[Any, list]] = {}
"""(id(pipeline), params) -> (the pipeline, kept alive so its id stays its own; its images)."""


def sd3_images(reference: Any, params: SamplingParams) -> list:
    """A StableDiffusion3Pipeline call (the tiny tokenizer_3 declares 64 tokens; diffuserve caps 256 by it), run
    once per session: the suite and test_family_sd3.py's same-tensors check compare with the same call."""
    key = (id(reference), params)
    if key not in _SD3_RUNS:
        _SD3_RUNS[key] = (
            reference,
            reference(
                params.prompt,
                negative_prompt=params.negative_prompt,
                height=params.height,
                width=params.width,
                num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale,
                num_images_per_prompt=params.n,
                generator=row_generators(params.seed, params.n),
                max_sequence_length=reference.tokenizer_3.model_max_length if reference.tokenizer_3 else 256,
            ).images,
        )
    return _SD3_RUNS[key][1]


def sd3_reference(subject: Subject, params: SamplingParams) -> list:
    return sd3_images(subject.diffusers("StableDiffusion3Pipeline", subject.path), params)


def wan_reference(subject: Subject, params: SamplingParams) -> list:
    frames = subject.diffusers("WanPipeline", subject.path)(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        height=params.height,
        width=params.width,
        num_frames=params.num_frames,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        guidance_scale_2=params.guidance_scale_2,
        output_type="np",
        generator=torch.Generator().manual_seed(params.seed),
    ).frames[0]
    return [_uint8_frames(frames)]


def wan_i2v_reference(subject: Subject, params: SamplingParams) -> list:
    clips = subject.diffusers("WanImageToVideoPipeline", subject.path)(
        image=_rgb(params)[0],
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        guidance_scale=params.guidance_scale,
        height=params.height,
        width=params.width,
        num_frames=params.num_frames,
        num_inference_steps=params.num_inference_steps,
        num_videos_per_prompt=params.n,
        output_type="np",
        generator=row_generators(params.seed, params.n),
    ).frames
    return [_uint8_frames(clip) for clip in clips]


def ltx2_call(subject: Subject, params: SamplingParams, **extra: Any) -> Any:
    """LTX2Pipeline (LTX2ImageToVideoPipeline with an input image) with the request's fields and its rows'
    generators: the output (`frames`, `audio`)."""
    image = {"image": _rgb(params)[0]} if params.image_inputs else {}
    name = "LTX2ImageToVideoPipeline" if params.image_inputs else "LTX2Pipeline"
    return subject.diffusers(name, subject.path)(
        **image,
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        guidance_scale=params.guidance_scale,
        height=params.height,
        width=params.width,
        num_frames=params.num_frames,
        frame_rate=float(params.fps),
        num_inference_steps=params.num_inference_steps,
        num_videos_per_prompt=params.n,
        output_type="np",
        generator=row_generators(params.seed, params.n),
        **extra,
    )


def ltx2_reference(subject: Subject, params: SamplingParams) -> list:
    return [_uint8_frames(clip) for clip in ltx2_call(subject, params).frames]


def _hunyuan_video_15_call(pipe: Any, params: SamplingParams, **inputs: Any) -> list:
    """One request through a HunyuanVideo 1.5 pipeline: its guidance lives in the guider (`__call__` takes none), so
    the call swaps in a guider of the request's scale. n == 1 only: diffusers 0.42.1's VAE cannot decode a batch."""
    from diffusers.guiders import ClassifierFreeGuidance

    assert params.n == 1, "diffusers 0.42.1's HunyuanVideo 1.5 VAE decodes one video per call"
    saved, pipe.guider = pipe.guider, ClassifierFreeGuidance(guidance_scale=params.guidance_scale)
    try:
        frames = pipe(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            num_frames=params.num_frames,
            num_inference_steps=params.num_inference_steps,
            output_type="np",
            generator=torch.Generator().manual_seed(params.seed),
            **inputs,
        ).frames[0]
    finally:
        pipe.guider = saved
    return [_uint8_frames(frames)]


def hunyuan_video_15_reference(subject: Subject, params: SamplingParams) -> list:
    pipe = subject.diffusers("HunyuanVideo15Pipeline", subject.path)
    return _hunyuan_video_15_call(pipe, params, height=params.height, width=params.width)


def hunyuan_video_15_i2v_reference(subject: Subject, params: SamplingParams) -> list:
    """The I2V pipeline sizes the video by the image (the `target_size` bucket nearest its aspect): the test images
    are square at the tiny checkpoint's target size, so that bucket is the request's size."""
    pipe = subject.diffusers("HunyuanVideo15ImageToVideoPipeline", subject.path)
    return _hunyuan_video_15_call(pipe, params, image=_rgb(params)[0])


def ernie_reference(subject: Subject, params: SamplingParams) -> list:
    return subject.diffusers("ErnieImagePipeline", subject.path)(
        [params.prompt] * params.n,
        negative_prompt=[params.negative_prompt or ""] * params.n,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        generator=row_generators(params.seed, params.n),
    ).images


def layered_reference(subject: Subject, params: SamplingParams) -> list:
    """Qwen-Image-Layered: the request's `n` is the number of layers of ONE call (one generator)."""
    source = Image.open(io.BytesIO(params.image_inputs[0])).convert("RGBA")
    return subject.diffusers("QwenImageLayeredPipeline", subject.path)(
        source,
        params.prompt,
        layers=params.n,
        num_inference_steps=params.num_inference_steps,
        true_cfg_scale=params.guidance_scale,
        generator=row_generators(params.seed, 1),
    ).images[0]


def tokenizer_tokens(native: Any, text: str) -> int:
    return len(native.adapter.tokenizer(text).input_ids)


def encoded_tokens(native: Any, text: str) -> int:
    """Tokens the text encoder really attends to (Qwen drops its template's system prefix)."""
    return int(native.encode_text("text_encoder", [text], [])["mask"].sum())
