"""`diffuserve calibrate-cache`: the magnitude ratios MagCache needs for one checkpoint.

It generates a few prompts with every step computed and records, per step, how the magnitude of the denoiser
blocks' residual changes from the previous step (diffusers' MagCache calibration formula, per row, averaged over
the rows). The output file is what `--step-cache-calibration FILE` loads for `step_cache: "magcache"` requests; it
records the family and the checkpoint's fingerprint (`models/fingerprint.py`), and a server refuses at start-up a
file made for another checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffuserve.pipelines.base import Pipeline

DEFAULT_PROMPTS = (
    "a red circle in the top left",
    "a blue square in the bottom right",
    "a photo of a cat on a sofa",
    "a mountain lake at sunrise",
)
"""Prompts of the calibration run when none are given (the ratios vary little with the prompt)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="The checkpoint to calibrate (a diffusers folder).")
    parser.add_argument("--output", required=True, help="JSON file to write the ratios to.")
    parser.add_argument(
        "--steps",
        type=int,
        default=28,
        help="Denoising steps of the calibration run (default: 28; other step counts interpolate the ratios).",
    )
    parser.add_argument("--prompt", action="append", default=None, help="A calibration prompt (repeatable).")
    parser.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's default size).")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu).")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32).")


def calibrate(
    pipeline: Pipeline, *, steps: int, prompts: tuple[str, ...] = DEFAULT_PROMPTS, size: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Run `prompts` on a loaded native pipeline with every step computed; the ratios per step, averaged."""
    from diffuserve.config.step_cache import StepCacheSettings
    from diffuserve.sampling import SamplingParams

    d = pipeline.defaults
    width, height = size or (d.width, d.height)
    settings = StepCacheSettings(method="magcache", calibrate=True)
    batch = [
        SamplingParams(
            prompt=prompt,
            width=width,
            height=height,
            num_frames=d.num_frames,
            num_inference_steps=steps,
            guidance_scale=d.guidance_scale,
            true_cfg_scale=d.true_cfg_scale,
            negative_prompt=d.negative_prompt,
            seed=i,
            step_cache=settings,
        )
        for i, prompt in enumerate(prompts)
    ]
    for params in batch:
        pipeline.validate(params)
    per_request = [output.step_cache["mag_ratios"] for output in pipeline.run(batch).outputs]
    ratios = [sum(step) / len(step) for step in zip(*per_request, strict=True)]
    denoiser = type(pipeline.components[pipeline.denoisers[0]]).__name__
    return {
        "denoiser": denoiser,
        "family": pipeline.family,
        "num_inference_steps": steps,
        "prompts": list(prompts),
        "mag_ratios": ratios,
    }


def run(ns: argparse.Namespace) -> int:
    from diffuserve.models.fingerprint import checkpoint_fingerprint
    from diffuserve.models.loader import load_pipeline

    pipeline = load_pipeline(ns.model_path, device=ns.device, dtype=ns.dtype)
    size = None
    if ns.size:
        width, height = (int(v) for v in ns.size.lower().split("x"))
        size = (width, height)
    result = calibrate(pipeline, steps=ns.steps, prompts=tuple(ns.prompt or DEFAULT_PROMPTS), size=size)
    result["model_path"] = str(ns.model_path)
    # What `--step-cache-calibration` checks at start-up: a file made for another checkpoint is refused.
    result["checkpoint"] = checkpoint_fingerprint(ns.model_path)
    Path(ns.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {len(result['mag_ratios'])} magnitude ratios of {result['denoiser']} to {ns.output}")
    return 0
