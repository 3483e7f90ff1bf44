"""Qwen-Image / Qwen-Image 2.1 on their tiny checkpoints: native vs diffusers call time, batch-8 vs batch-1.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_qwen_image.py [--runs 10] [--size 64] [--steps 4]

`calls(family, model_path, ...)` is the hook for `benchmarks/bench_families.py`: two zero-argument callables
running the same generation natively and through the diffusers pipeline (built around the same loaded
modules), each family with its own default guidance (Qwen-Image: true CFG 4 with negative " "; 2.1: none).
Runs are interleaved (the order alternates every round) so machine load hits both sides alike; medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = (
    "a cat surfing a wave at sunset",
    "a red house on a green mountain",
    "a small bird in a tree",
    "a portrait of an old dog",
    "a blue river at night",
    "a yellow sun over the sea",
    "a painting of a city",
    "a black and white photo of a forest",
)
TINY = {"qwen_image": "qwen-image", "qwen_image_21": "qwen-image-2.1"}


def calls(
    family: str, model_path: Path, *, size: int = 64, steps: int = 4, batch: int = 1, seed: int = 0
) -> dict[str, Callable[[], Any]]:
    """{"native": fn, "diffusers": fn}: the same `batch` prompts at `size` px and `steps` steps, one seed per row."""
    import torch
    from diffusers import QwenImage21Pipeline, QwenImagePipeline

    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    pipe = load_pipeline(model_path)
    if pipe.family != family:
        raise ValueError(f"{model_path} is a {pipe.family} checkpoint, not {family}")
    d = pipe.defaults
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = [
        SamplingParams(
            prompt=p,
            negative_prompt=d.negative_prompt,
            true_cfg_scale=d.true_cfg_scale,
            width=size,
            height=size,
            num_inference_steps=steps,
            seed=seed + i,
        )
        for i, p in enumerate(prompts)
    ]
    modules = {
        "scheduler": pipe.adapter.scheduler,
        "vae": pipe.adapter.vae,
        "text_encoder": pipe.adapter.text_encoder,
        "transformer": pipe.adapter.transformer,
    }
    if family == "qwen_image":
        reference = QwenImagePipeline(tokenizer=pipe.adapter.tokenizer, **modules)
    else:
        reference = QwenImage21Pipeline(processor=pipe.adapter.processor, **modules)
    reference.set_progress_bar_config(disable=True)
    negative = None if d.negative_prompt is None else [d.negative_prompt] * batch

    def native() -> Any:
        return pipe.run(params)

    def diffusers_call() -> Any:
        return reference(
            prompt=prompts,
            negative_prompt=negative,
            true_cfg_scale=d.true_cfg_scale,
            height=size,
            width=size,
            num_inference_steps=steps,
            generator=[torch.Generator().manual_seed(seed + i) for i in range(batch)],
        )

    return {"native": native, "diffusers": diffusers_call}


def _median_times(fns: dict[str, Callable[[], Any]], runs: int, warmup: int) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(runs):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--runs", type=int, default=10, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per side first")
    args = parser.parse_args(argv)

    from diffuserve.models.tiny import build_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="bench-qwen-"))
    print(f"{args.size}px, {args.steps} steps, medians of {args.runs} interleaved runs")
    print("family          native ms  diffusers ms  native/diffusers  b1 img/s  b8 img/s  b8/b1")
    for family, name in TINY.items():
        path = build_tiny_checkpoint(name, root / name)
        one = _median_times(calls(family, path, size=args.size, steps=args.steps), args.runs, args.warmup)
        b1 = calls(family, path, size=args.size, steps=args.steps, batch=1)["native"]
        b8 = calls(family, path, size=args.size, steps=args.steps, batch=8)["native"]
        tput = _median_times({"b1": b1, "b8": b8}, args.runs, args.warmup)
        r1, r8 = 1 / tput["b1"], 8 / tput["b8"]
        print(
            f"{family:<15} {one['native'] * 1e3:9.1f}  {one['diffusers'] * 1e3:12.1f}  "
            f"{one['native'] / one['diffusers']:16.2f}  {r1:8.1f}  {r8:8.1f}  {r8 / r1:5.2f}"
        )


if __name__ == "__main__":
    main()
