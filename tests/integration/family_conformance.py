"""The family conformance cases: one `FamilyCase` per served family (tiny checkpoint), read by
`test_family_conformance.py`, whose generic checks each run for the cases that say they apply.

Adding a family is adding a case here (and, for the diffusers comparison, its call in family_references.py). Facts that
fit no generic check stay in the family's own small test file (`test_family_<family>.py`).

Tolerances are uint8 steps (of 255) per pixel channel:
- native vs a diffusers pipeline built on the SAME loaded modules, or on the same folder with the same classes
  (sana, z-image, qwen edit, wan, ernie, layered): exact (0). Same kernels on the same tensors in the same order;
  any difference is a recipe bug.
- native vs a separately loaded diffusers copy where safetensors alignment moves CPU kernels (sd3): <= 1; HunyuanVideo
  1.5 (T2V, I2V): <= 1 (native cuts the masked text padding, so attention sums over fewer zero terms; observed 0).
- a merged row vs its singleton run: <= 1 (batched kernels may reorder float sums); observed 0-1.
- residency modes vs resident: 0 (the runtime re-attaches the same tensors on CPU); FLUX.2 keeps its <= 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diffuserve.sampling import SamplingParams, build_sampling_params
from tests.integration.family_references import (
    Reference,
    encoded_tokens,
    ernie_reference,
    flux2_reference,
    hunyuan_video_15_i2v_reference,
    hunyuan_video_15_reference,
    layered_reference,
    ltx2_reference,
    png,
    qwen_edit_reference,
    qwen_reference,
    rgba_png,
    sana_reference,
    sd3_reference,
    tokenizer_tokens,
    two_tone_png,
    wan_i2v_reference,
    wan_reference,
    z_image_reference,
)

# -- the cases --------------------------------------------------------------------------------------------------


def plain_params(native: Any, fields: dict[str, Any]) -> SamplingParams:
    """A request's params as written (no family defaults)."""
    return SamplingParams(**fields)


def video_params(native: Any, fields: dict[str, Any]) -> SamplingParams:
    """A video request through THE builder (family defaults filled, the model's checks run)."""
    return build_sampling_params(native.describe_model(), **{**WAN_SMALL, **fields})


def ltx2_params(native: Any, fields: dict[str, Any]) -> SamplingParams:
    """An LTX-2 request through THE builder, at the tiny checkpoint's suggested size, frames and steps."""
    return build_sampling_params(native.describe_model(), **fields)


WAN_SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3}
SHORT, LONG = "a cat", "a very detailed painting of a big old house by the sea at night with stars"
QWEN_LONG = "a big old red house on a small green mountain under the night sky"
QWEN_CFG = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}
RED, BLUE_WIDE = two_tone_png(64, 64, (200, 30, 30)), two_tone_png(80, 48, (30, 30, 200))
QWEN_EDIT = {
    "prompt": "make the sky green",
    "negative_prompt": " ",
    "true_cfg_scale": 4.0,
    "width": 64,
    "height": 64,
    "num_inference_steps": 2,
}
"""The Qwen edit family defaults (true CFG 4 with a " " negative prompt) spelled out for an explicit diffusers call."""


@dataclass(frozen=True)
class FamilyCase:
    """One family on its tiny checkpoint, and which generic checks apply to it (empty / None = not this one)."""

    id: str
    """Test id; also `tiny-<id>`, the served model name of its server."""
    tiny: str
    """`make-tiny --family` name of its checkpoint."""
    family: str
    """`pipeline.family` of the loaded checkpoint."""
    pipeline_class: str
    """Class name `load_pipeline` returns (the native adapter, or DiffusersBackendPipeline)."""
    output: str = "image"
    """`image` or `video` (which output list the checks compare)."""
    build_params: Callable[[Any, dict[str, Any]], SamplingParams] = plain_params
    """fields -> SamplingParams: as written, or through the model's builder (video)."""
    rebuild: bool = True
    """A second build is byte-identical and under `max_bytes` (False: checked elsewhere, FLUX.1 in test_loader.py)."""
    max_bytes: int = 10 * 2**20
    """The tiny checkpoint's size limit."""
    reference: Reference | None = None
    """The diffusers call native must equal, on `reference_params`."""
    reference_params: tuple[tuple[str, dict[str, Any]], ...] = ()
    """(id, request fields) compared with `reference`."""
    reference_tolerance: int = 0
    sized_as_requested: bool = True
    """Output images have the requested width x height (Qwen-Image-Layered sizes by its own area rule)."""
    merge_batches: tuple[tuple[dict[str, Any], ...], ...] = ()
    """Batches of request fields run merged and compared row by row with each request run alone."""
    merge_tolerance: int = 1
    merged_rows_differ: bool = False
    """Also: the first rows of the first two merged requests are really different images (> 8/255)."""
    token_ratio: int | None = None
    """Merged prompts really differ in length: the second request's prompt has more than ratio x the first's
    tokens (as `count_tokens` counts them)."""
    count_tokens: Callable[[Any, str], int] | None = None
    """(native, text) -> its tokens, for `token_ratio`."""
    packed_batches: tuple[tuple[dict[str, Any], ...], ...] = ()
    """Batches of request fields of DIFFERENT sizes (and text lengths) the family runs packed (`packs_mixed_sizes`):
    one denoiser call per step (per CFG branch), each row equal to its request run alone (`merge_tolerance`)."""
    continuous: bool = False
    """The family runs continuous batching: `supports_continuous`, and a join equals its singleton run."""
    residency_batch: tuple[dict[str, Any], ...] = ()
    """A batch run under each offload mode and compared with the resident run."""
    residency_tolerance: int = 0
    layered: frozenset[str] = frozenset()
    """Components with declared repeated layers (what layer-wise offload streams): at least these."""
    layer_specs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(component, its exact declared layer lists)."""
    streamed_layers: frozenset[tuple[str, str]] = frozenset()
    """(component, layer list) that really stream under layer-wise offload."""
    size_multiple: int | None = None
    max_side: int | None = None
    """The positional tables' largest side: accepted, one size step more a 400 naming `size`."""
    size_error_match: str | None = None
    """Text the beyond-the-tables error must contain."""
    off_grid: tuple[tuple[int, int], ...] = ()
    """(width, height) off the size grid: refused naming `size`."""
    warns_long_prompt: bool = False
    """A prompt longer than a text encoder takes is reported (today FLUX.1 only; one line per family to enable)."""
    server_args: tuple[str, ...] | None = None
    """Extra flags of its one real server (None: no server)."""
    server_request: dict[str, Any] = field(default_factory=dict)
    """Fields of one images.generate call (prompt, width, height, n, seed, steps, guidance ...)."""
    server_reference: str = "native"
    """What the server's images must equal: `native` (the in-process run) or `diffusers` (`reference`)."""
    server_tolerance: int = 0
    http_refused_size: str | None = None
    """A size the server refuses with a 400 naming `size`."""
    http_refused_message: str | None = None


FLUX2_REFERENCE = tuple(
    (
        name,
        {
            "prompt": "a photo of a red cat",
            "width": 48,
            "height": 64,
            "num_inference_steps": 3,
            "seed": 11,
            "n": 2,
            "guidance_scale": 1.0 if name == "t2i-nocfg" else 4.0,
            "image_inputs": images,
        },
    )
    for name, images in (
        ("t2i", ()),
        ("t2i-nocfg", ()),
        ("reference", (png(),)),
        ("two-references", (png(), png(64, 128, seed=1))),
    )
)
FLUX2_MERGE = (
    (
        {"prompt": SHORT, "width": 64, "height": 64, "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 1},
        {
            "prompt": "a small green dog with a blue hat, painting",
            "width": 64,
            "height": 64,
            "num_inference_steps": 2,
            "guidance_scale": 4.0,
            "seed": 9,
            "n": 2,
        },
    ),
)
# An edit: the VAE encodes the reference under its scope too; Klein's CFG runs both text branches.
FLUX2_RESIDENCY = (
    {
        "prompt": "a red cat",
        "width": 64,
        "height": 64,
        "num_inference_steps": 2,
        "guidance_scale": 4.0,
        "seed": 2,
        "image_inputs": (png(),),
    },
)
FLUX2_SERVER = {"prompt": "a blue dog", "width": 64, "height": 64, "n": 2, "seed": 21, "num_inference_steps": 2}


def _flux2_case(id: str, family: str, pipeline_class: str) -> FamilyCase:
    return FamilyCase(
        id,
        id,
        family,
        pipeline_class,
        reference=flux2_reference,
        reference_params=FLUX2_REFERENCE,
        merge_batches=FLUX2_MERGE,
        merged_rows_differ=True,
        packed_batches=packed_batch(guidance_scale=4.0) + packed_batch(guidance_scale=1.0),
        continuous=True,
        residency_batch=FLUX2_RESIDENCY,
        residency_tolerance=1,
        layered=frozenset({"transformer", "text_encoder", "vae"}),
        size_multiple=16,
        off_grid=((72, 64),),
        server_args=(),
        server_request=FLUX2_SERVER,
        server_tolerance=1,
    )


def _qwen_case(id: str, family: str, size_multiple: int, max_side: int) -> FamilyCase:
    no_cfg, cfg = {"true_cfg_scale": 1.0}, {"true_cfg_scale": 4.0}
    base = {"width": 64, "height": 64, "num_inference_steps": 2}
    return FamilyCase(
        id,
        id,
        family,
        {"qwen_image": "QwenImageAdapter"}.get(family, "QwenImage21Adapter"),
        reference=qwen_reference,
        reference_params=(("long-cfg-n2", {**base, "prompt": QWEN_LONG, "seed": 7, "n": 2, **QWEN_CFG}),),
        merge_batches=(
            (
                {**base, "prompt": SHORT, "seed": 1, **no_cfg},
                {**base, "prompt": QWEN_LONG, "seed": 2, "n": 2, **no_cfg},
            ),
            (
                {**base, "prompt": SHORT, "seed": 1, "negative_prompt": "blurry", **cfg},
                {**base, "prompt": QWEN_LONG, "seed": 2, "n": 2, "negative_prompt": "low quality, ugly, dark", **cfg},
            ),
        ),
        token_ratio=1,
        count_tokens=encoded_tokens,
        # Qwen-Image 2.1's block-causal prefix KV cache is kept per text length: it does not pack (its spec says why).
        packed_batches=(
            packed_batch(**no_cfg) + packed_batch(negative_prompt="low quality, ugly", **cfg)
            if family == "qwen_image"
            else ()
        ),
        continuous=True,
        residency_batch=(
            {**base, "prompt": SHORT, "seed": 3, **QWEN_CFG},
            {**base, "prompt": QWEN_LONG, "seed": 4, **QWEN_CFG},
        ),
        layered=frozenset({"transformer", "text_encoder", "vae"}),
        layer_specs=(("transformer", ("transformer_blocks",)), ("text_encoder", ("model.language_model.layers",))),
        size_multiple=size_multiple,
        max_side=max_side,
        off_grid=((size_multiple + 8, 64),),
        server_args=(),
        server_request={
            "prompt": QWEN_LONG,
            "width": 64,
            "height": 64,
            "n": 1,
            "seed": 11,
            "num_inference_steps": 2,
            **QWEN_CFG,
        },
    )


_EDIT_ARGS = (
    "--batching-mode",
    "dynamic",
    "--batching-max-size",
    "4",
    "--batching-delay-ms",
    "50",
    "--enable-batching-metrics",
)
"""Dynamic batching on, so the dispatch line shows why an edit runs alone. Warm-up stays on: an edit-only model
warms up with a gray input image."""


def packed_batch(steps: int = 2, **common: Any) -> tuple[tuple[dict[str, Any], ...], ...]:
    """Two sizes, different text lengths, n=2 on one, and a third request back at the first size (the size groups
    are not contiguous in the batch as given): rows of a packed call."""
    return (
        (
            {"prompt": SHORT, "width": 64, "height": 64, "seed": 1, "num_inference_steps": steps, **common},
            {
                "prompt": "a small green dog with a blue hat, painting in the style of an old master, dusk",
                "width": 96,
                "height": 64,
                "seed": 9,
                "n": 2,
                "num_inference_steps": steps,
                **common,
            },
            {"prompt": "a red cube", "width": 64, "height": 64, "seed": 4, "num_inference_steps": steps, **common},
        ),
    )


PACKED_FLUX = packed_batch(guidance_scale=3.5) + packed_batch(
    guidance_scale=3.5, true_cfg_scale=2.0, negative_prompt="blurry"
)

CASES: tuple[FamilyCase, ...] = (
    FamilyCase(
        "flux",
        "flux",
        "flux",
        "FluxAdapter",
        packed_batches=PACKED_FLUX,
        continuous=True,
        warns_long_prompt=True,
        size_multiple=16,
        rebuild=False,
    ),
    _flux2_case("flux2", "flux2", "Flux2Adapter"),
    _flux2_case("flux2-klein", "flux2_klein", "Flux2KleinAdapter"),
    # The RoPE tables' limits: Qwen-Image's text starts max(h, w) // 2 positions in; 2.1 centres rows.
    _qwen_case("qwen-image", "qwen_image", 16, 114688),
    _qwen_case("qwen-image-2.1", "qwen_image_21", 32, 32768),
    FamilyCase(
        "qwen-image-edit",
        "qwen-image-edit",
        "qwen_image_edit",
        "QwenImageEditAdapter",
        reference=qwen_edit_reference("QwenImageEditPipeline"),
        reference_params=(("edit-n2", {**QWEN_EDIT, "seed": 11, "n": 2, "image_inputs": (RED,)}),),
        server_args=_EDIT_ARGS,
    ),
    FamilyCase(
        "qwen-image-edit-plus",
        "qwen-image-edit-plus",
        "qwen_image_edit_plus",
        "QwenImageEditPlusAdapter",
        reference=qwen_edit_reference("QwenImageEditPlusPipeline"),
        reference_params=(("two-images", {**QWEN_EDIT, "seed": 5, "n": 1, "image_inputs": (RED, BLUE_WIDE)}),),
        server_args=_EDIT_ARGS,
    ),
    FamilyCase(
        "sana",
        "sana",
        "sana",
        "SanaAdapter",
        reference=sana_reference,
        reference_params=(
            ("no-cfg", {"prompt": "a red cat", "seed": 7, "guidance_scale": 1.0, "num_inference_steps": 2}),
            # CFG with the default empty negative prompt, two rows.
            ("cfg-n2", {"prompt": "A Small Dog ", "seed": 3, "guidance_scale": 4.5, "n": 2, "num_inference_steps": 2}),
            # Non-square: generated at the closest bin and resized/cropped back, as diffusers does.
            (
                "cfg-negative-binned",
                {
                    "prompt": "sea at night",
                    "negative_prompt": "blurry",
                    "seed": 5,
                    "guidance_scale": 4.0,
                    "width": 96,
                    "height": 64,
                    "num_inference_steps": 3,
                },
            ),
        ),
        # Request 2's negative prompt is request 1's prompt: SANA encodes the two roles differently.
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "guidance_scale": 3.0, "num_inference_steps": 2},
                {
                    "prompt": LONG,
                    "negative_prompt": SHORT,
                    "seed": 2,
                    "guidance_scale": 3.0,
                    "n": 2,
                    "num_inference_steps": 2,
                },
            ),
        ),
        merged_rows_differ=True,
        token_ratio=3,
        count_tokens=tokenizer_tokens,
        continuous=True,
        residency_batch=({"prompt": "a green tree", "seed": 9, "guidance_scale": 2.0, "num_inference_steps": 2},),
        streamed_layers=frozenset(
            {("transformer", "transformer_blocks"), ("text_encoder", "layers"), ("vae", "decoder.up_blocks")}
        ),
        size_multiple=32,
        server_args=(),
        server_reference="diffusers",
        server_request={
            "prompt": "a blue car",
            "width": 64,
            "height": 64,
            "n": 1,
            "seed": 11,
            "num_inference_steps": 2,
            "guidance_scale": 4.5,
        },
        http_refused_size="80x64",
    ),
    FamilyCase(
        "z-image",
        "z-image",
        "z_image",
        "ZImageAdapter",
        packed_batches=packed_batch(guidance_scale=0.0) + packed_batch(guidance_scale=4.0),
        reference=z_image_reference,
        reference_params=(
            # Turbo-style: guidance 0 runs no negative branch.
            ("no-cfg", {"prompt": "a red cat", "seed": 7, "guidance_scale": 0.0, "num_inference_steps": 2}),
            # CFG (any guidance > 0) with the default empty negative prompt, non-square, two rows.
            (
                "cfg-n2-nonsquare",
                {
                    "prompt": "a small dog on a big old house",
                    "seed": 3,
                    "guidance_scale": 3.0,
                    "n": 2,
                    "width": 64,
                    "height": 32,
                    "num_inference_steps": 2,
                },
            ),
            (
                "cfg-negative",
                {
                    "prompt": "sea at night",
                    "negative_prompt": "blurry",
                    "seed": 5,
                    "guidance_scale": 4.0,
                    "num_inference_steps": 3,
                },
            ),
        ),
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "guidance_scale": 3.0, "num_inference_steps": 2},
                {
                    "prompt": LONG,
                    "negative_prompt": "dark",
                    "seed": 2,
                    "guidance_scale": 3.0,
                    "n": 2,
                    "num_inference_steps": 2,
                },
            ),
        ),
        merged_rows_differ=True,
        token_ratio=3,
        count_tokens=tokenizer_tokens,
        continuous=True,
        residency_batch=({"prompt": "a green tree", "seed": 9, "guidance_scale": 2.0, "num_inference_steps": 2},),
        streamed_layers=frozenset(
            {
                ("transformer", "noise_refiner"),
                ("transformer", "context_refiner"),
                ("transformer", "layers"),
                ("text_encoder", "layers"),
            }
        ),
        max_side=512,  # the tiny config's axes_lens allow 32 patches (512 px) per side
        server_args=(),
        server_reference="diffusers",
        server_request={
            "prompt": "a blue car",
            "width": 64,
            "height": 64,
            "n": 1,
            "seed": 11,
            "num_inference_steps": 2,
            "guidance_scale": 2.5,
        },
        http_refused_size="1024x1024",
    ),
    FamilyCase(
        "sd3",
        "sd3",
        "sd3",
        "SD3Adapter",
        packed_batches=packed_batch(guidance_scale=7.0) + packed_batch(guidance_scale=1.0),
        reference=sd3_reference,
        reference_tolerance=1,
        reference_params=(
            # diffusers' defaults: CFG at 7.0 against the empty negative prompt
            (
                "cfg-default-negative",
                {"prompt": "a photo of a cat", "seed": 5, "n": 2, "num_inference_steps": 3, "guidance_scale": 7.0},
            ),
            (
                "cfg-negative-48x32",
                {
                    "prompt": "a red fox",
                    "negative_prompt": "blurry",
                    "seed": 1,
                    "num_inference_steps": 3,
                    "guidance_scale": 4.5,
                    "width": 48,
                    "height": 32,
                },
            ),
            # guidance_scale <= 1: no CFG branch at all
            ("no-cfg", {"prompt": "a tree", "seed": 2, "num_inference_steps": 3, "guidance_scale": 1.0}),
        ),
        # Prompts of different token lengths (and one repeated), negative prompts on some rows.
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "n": 2, "num_inference_steps": 2, "guidance_scale": 5.0},
                {
                    "prompt": "a detailed painting of an old house by the sea at night",
                    "negative_prompt": "dark",
                    "seed": 9,
                    "num_inference_steps": 2,
                    "guidance_scale": 5.0,
                },
                {"prompt": SHORT, "seed": 4, "num_inference_steps": 2, "guidance_scale": 5.0},
            ),
        ),
        continuous=True,
        residency_batch=(
            {
                "prompt": "a red cat",
                "negative_prompt": "blurry",
                "seed": 7,
                "n": 2,
                "num_inference_steps": 2,
                "guidance_scale": 4.0,
            },
        ),
        # The DiT and all three text encoders have repeated layers: layer-wise streams each of them.
        layered=frozenset({"transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"}),
        size_multiple=16,
        max_side=32 * 2 * 8,
        size_error_match="positional table",
        server_args=("--warmup-steps", "1"),
        server_tolerance=1,
        server_request={
            "prompt": "a blue bird",
            "width": 64,
            "height": 64,
            "n": 2,
            "seed": 11,
            "num_inference_steps": 2,
            "guidance_scale": 3.0,
        },
        http_refused_size="528x528",
        http_refused_message="512",
    ),
    FamilyCase(
        "wan",
        "wan",
        "wan",
        "WanAdapter",
        output="video",
        build_params=video_params,
        reference=wan_reference,
        reference_params=(
            (
                "cfg-negative",
                {"prompt": "a cat surfing", "seed": 3, "guidance_scale": 4.0, "negative_prompt": "blurry"},
            ),
        ),
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "guidance_scale": 3.0},
                {"prompt": "a dog running along a long sandy beach at dusk", "seed": 2, "guidance_scale": 3.0, "n": 2},
            ),
        ),
        continuous=True,
        residency_batch=({"prompt": "a red kite", "seed": 4, "guidance_scale": 3.0},),
    ),
    FamilyCase(
        "wan2.2",
        "wan2.2",
        "wan",
        "WanAdapter",
        output="video",
        build_params=video_params,
        reference=wan_reference,
        reference_params=(
            ("two-experts", {"prompt": "a cat surfing", "seed": 3, "guidance_scale": 4.0, "guidance_scale_2": 2.0}),
        ),
        continuous=True,
        residency_batch=({"prompt": "a red kite", "seed": 4, "guidance_scale": 3.0},),
    ),
    FamilyCase(
        "wan2.2-ti2v",
        "wan2.2-ti2v",
        "wan",
        "WanAdapter",
        output="video",
        build_params=video_params,
        reference=wan_reference,
        reference_params=(("no-cfg", {"prompt": "a cat surfing", "seed": 3, "guidance_scale": 1.0}),),
        continuous=True,
    ),
    FamilyCase(
        "wan-i2v",
        "wan-i2v",
        "wan_i2v",
        "WanI2VAdapter",
        output="video",
        build_params=video_params,
        reference=wan_i2v_reference,
        reference_params=(
            (
                "cfg-negative-n2",
                {
                    "prompt": "a cat",
                    "seed": 2,
                    "guidance_scale": 4.0,
                    "negative_prompt": "blurry",
                    "n": 2,
                    "image_inputs": (png(32, 32, 1),),
                },
            ),
        ),
        residency_batch=({"prompt": "a kite", "seed": 5, "guidance_scale": 3.0, "image_inputs": (png(32, 32, 2),)},),
    ),
    FamilyCase(
        "ernie",
        "ernie-image",
        "ernie_image",
        "DiffusersBackendPipeline",
        reference=ernie_reference,
        reference_params=(
            ("no-cfg-n2", {"prompt": "a red cat", "seed": 7, "guidance_scale": 1.0, "n": 2, "num_inference_steps": 2}),
            (
                "cfg-negative-wide",
                {
                    "prompt": "a dog in the sea",
                    "negative_prompt": "blurry",
                    "seed": 3,
                    "guidance_scale": 4.0,
                    "width": 96,
                    "height": 64,
                    "num_inference_steps": 2,
                },
            ),
        ),
        # ERNIE encodes every prompt alone and pads; only the batch size of the kernels differs.
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "guidance_scale": 4.0, "num_inference_steps": 2},
                {
                    "prompt": "a very detailed painting of a big old house by the sea at night",
                    "seed": 2,
                    "guidance_scale": 4.0,
                    "n": 2,
                    "num_inference_steps": 2,
                },
            ),
        ),
        merged_rows_differ=True,
        server_args=(),
        server_reference="diffusers",
        server_tolerance=1,
        server_request={
            "prompt": "a blue car",
            "width": 64,
            "height": 64,
            "n": 2,
            "seed": 11,
            "num_inference_steps": 2,
            "guidance_scale": 4.0,
        },
        http_refused_size="72x64",
    ),
    FamilyCase(
        "qwen-image-layered",
        "qwen-image-layered",
        "qwen_image_layered",
        "DiffusersBackendPipeline",
        reference=layered_reference,
        sized_as_requested=False,
        reference_params=(
            (
                "two-layers",
                {
                    "prompt": "a red cat",
                    "seed": 5,
                    "n": 2,
                    "guidance_scale": 1.0,
                    "num_inference_steps": 2,
                    "image_inputs": (rgba_png(64, 48),),
                },
            ),
        ),
    ),
    FamilyCase(
        "glm-image", "glm-image", "glm_image", "DiffusersBackendPipeline", size_multiple=32, off_grid=((48, 64),)
    ),
    FamilyCase(
        "hunyuan-video",
        "hunyuan-video",
        "hunyuan_video",
        "DiffusersBackendPipeline",
        output="video",
        max_bytes=20 * 2**20,
        server_args=(),
    ),
    FamilyCase(
        "hunyuan-video-1.5",
        "hunyuan-video-1.5",
        "hunyuan_video_15",
        "HunyuanVideo15Adapter",
        output="video",
        build_params=video_params,
        max_bytes=20 * 2**20,
        reference=hunyuan_video_15_reference,
        reference_tolerance=1,
        reference_params=(
            ("no-cfg", {"prompt": "a cat surfing", "seed": 3, "guidance_scale": 1.0}),
            (
                "cfg-negative-glyphs",
                {"prompt": 'a sign that says "OPEN"', "seed": 5, "guidance_scale": 4.0, "negative_prompt": "blurry"},
            ),
        ),
        # Rows decode one at a time (diffusers 0.42.1's VAE cannot decode a batch); texts of different lengths, a
        # quoted glyph text (ByT5) in one row only, a negative prompt and n per row.
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "guidance_scale": 3.0},
                {
                    "prompt": 'a dog holding a sign "HELLO" on a long sandy beach',
                    "seed": 2,
                    "guidance_scale": 3.0,
                    "n": 2,
                },
                {"prompt": "a kite", "seed": 7, "guidance_scale": 3.0, "negative_prompt": "dark"},
            ),
        ),
        merged_rows_differ=True,
        continuous=True,
        size_multiple=4,
        off_grid=((34, 32), (32, 30)),
        residency_batch=({"prompt": "a red kite", "seed": 4, "guidance_scale": 3.0},),
        layered=frozenset({"transformer", "text_encoder", "text_encoder_2", "vae"}),
        streamed_layers=frozenset({("transformer", "transformer_blocks"), ("vae", "decoder.up_blocks")}),
    ),
    FamilyCase(
        "hunyuan-video-1.5-i2v",
        "hunyuan-video-1.5-i2v",
        "hunyuan_video_15_i2v",
        "HunyuanVideo15I2VAdapter",
        output="video",
        build_params=video_params,
        max_bytes=20 * 2**20,
        reference=hunyuan_video_15_i2v_reference,
        reference_tolerance=1,
        reference_params=(
            ("no-cfg", {"prompt": "a cat", "seed": 2, "guidance_scale": 1.0, "image_inputs": (png(32, 32, 1),)}),
            (
                "cfg-negative",
                {
                    "prompt": "a cat",
                    "seed": 2,
                    "guidance_scale": 4.0,
                    "negative_prompt": "blurry",
                    "image_inputs": (png(32, 32, 1),),
                },
            ),
        ),
        # Each row conditions on its own request's image.
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1, "guidance_scale": 3.0, "image_inputs": (png(32, 32, 1),)},
                {"prompt": "a dog", "seed": 2, "guidance_scale": 3.0, "n": 2, "image_inputs": (png(48, 32, 2),)},
            ),
        ),
        merged_rows_differ=True,
        residency_batch=({"prompt": "a kite", "seed": 5, "guidance_scale": 3.0, "image_inputs": (png(32, 32, 2),)},),
        layered=frozenset({"transformer", "text_encoder", "text_encoder_2", "vae", "image_encoder"}),
    ),
    FamilyCase(
        "ltx2",
        "ltx2",
        "ltx2",
        "LTX2Adapter",
        output="video",
        max_bytes=20 * 2**20,
        build_params=ltx2_params,
        reference=ltx2_reference,
        reference_params=(
            ("cfg-negative-n2", {"prompt": "a cat surfing", "seed": 3, "negative_prompt": "blurry", "n": 2}),
            ("i2v", {"prompt": "a cat", "seed": 2, "guidance_scale": 4.0, "image_inputs": (png(32, 32),)}),
        ),
        reference_tolerance=1,
        merge_batches=(
            (
                {"prompt": SHORT, "seed": 1},
                {"prompt": "a dog running along a beach", "seed": 2, "n": 2, "negative_prompt": "dark", "fps": 12},
                {"prompt": "a cat", "seed": 5, "image_inputs": (png(32, 32, seed=1),)},
            ),
        ),
        continuous=True,
        residency_batch=({"prompt": "a red kite", "seed": 4},),
        layered=frozenset({"transformer", "text_encoder", "vae"}),
        streamed_layers=frozenset({("transformer", "transformer_blocks"), ("vae", "decoder.up_blocks")}),
        size_multiple=32,
        off_grid=((48, 32),),
    ),
    FamilyCase(
        "ltx2.3",
        "ltx2.3",
        "ltx2",
        "LTX2Adapter",
        output="video",
        max_bytes=20 * 2**20,
        build_params=ltx2_params,
        reference=ltx2_reference,
        reference_params=(("cfg-negative", {"prompt": "a cat surfing", "seed": 3, "negative_prompt": "blurry"}),),
        reference_tolerance=1,
        continuous=True,
    ),
    FamilyCase("helios", "helios", "helios", "DiffusersBackendPipeline", output="video", max_bytes=20 * 2**20),
)
BY_ID = {case.id: case for case in CASES}


def ids(check: Callable[[FamilyCase], Any]) -> list[str]:
    """The ids of the cases a check applies to (`check(case)` truthy)."""
    return [case.id for case in CASES if check(case)]
