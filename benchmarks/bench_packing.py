"""Packed mixed-size denoiser calls vs separate per-size calls, in process, on a FLUX.1-style checkpoint.

    .venv/bin/python benchmarks/bench_packing.py                          # tiny and 36m (36m: many minutes on 2 cores)
    .venv/bin/python benchmarks/bench_packing.py --scenarios 36m --rounds 5

One mixed batch per scenario (requests of two or three sizes, one output each, 4 steps), run two ways, round by
round with the order alternating so that load from other processes hits both alike:

- `packed`: `pipeline.run(batch)`: one denoiser call per step for every row (`pipelines/packing.py`);
- `per-size`: `pipeline.run(group)` for each size group in turn: today's size-grouped batches, one call per size
  per step.

The figures: wall seconds of the whole batch and of its denoise stage (the pipeline's `stage_seconds`), medians
over rounds, the packed/per-size ratio of each, and the padding share of the packed call's tokens. Every packed
row is checked against its per-size row (<= 1/255) before timing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from diffuserve.models.loader import load_pipeline
from diffuserve.models.tiny import build_tiny_checkpoint
from diffuserve.sampling import SamplingParams

SCENARIOS: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = {
    # (tiny preset, the batch's sizes): the tiny model is overhead-bound; 36m saturates the CPU.
    "tiny": ("tiny", ((64, 64), (64, 64), (96, 64), (128, 128))),
    "36m": ("36m", ((256, 256), (256, 256), (256, 384), (384, 384))),
}


def _batch(sizes: tuple[tuple[int, int], ...], steps: int) -> list[SamplingParams]:
    return [
        SamplingParams(prompt=f"request {i}", width=w, height=h, num_inference_steps=steps, seed=i, guidance_scale=3.5)
        for i, (w, h) in enumerate(sizes)
    ]


def _groups(batch: list[SamplingParams]) -> list[list[SamplingParams]]:
    groups: dict[tuple[int, int], list[SamplingParams]] = {}
    for params in batch:
        groups.setdefault((params.width, params.height), []).append(params)
    return list(groups.values())


def _packed(pipeline: Any, batch: list[SamplingParams]) -> tuple[float, float, list[Any]]:
    start = time.perf_counter()
    result = pipeline.run(batch)
    return time.perf_counter() - start, result.stage_seconds.get("denoise", 0.0), [o.images[0] for o in result.outputs]


def _per_size(pipeline: Any, batch: list[SamplingParams]) -> tuple[float, float, list[Any]]:
    start, denoise, images = time.perf_counter(), 0.0, {}
    for group in _groups(batch):
        result = pipeline.run(group)
        denoise += result.stage_seconds.get("denoise", 0.0)
        images.update({id(p): o.images[0] for p, o in zip(group, result.outputs, strict=True)})
    return time.perf_counter() - start, denoise, [images[id(p)] for p in batch]


def _padding_share(pipeline: Any, batch: list[SamplingParams]) -> float:
    tokens = [(p.width // 16) * (p.height // 16) for p in batch]
    return 1 - sum(tokens) / (len(tokens) * max(tokens))  # latent tokens only (every row's text is one length)


def run_scenario(name: str, rounds: int, steps: int) -> dict[str, Any]:
    preset, sizes = SCENARIOS[name]
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = load_pipeline(build_tiny_checkpoint("flux", Path(tmp) / name, preset=preset))
    batch = _batch(sizes, steps)
    _, _, packed_images = _packed(pipeline, batch)  # warm-up, and the check
    _, _, separate_images = _per_size(pipeline, batch)
    worst = max(
        int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())
        for a, b in zip(packed_images, separate_images, strict=True)
    )
    assert worst <= 1, f"a packed row differs from its per-size row by {worst}/255"
    times: dict[str, list[tuple[float, float]]] = {"packed": [], "per-size": []}
    for r in range(rounds):
        order = (("packed", _packed), ("per-size", _per_size))
        for label, fn in order if r % 2 == 0 else order[::-1]:
            wall, denoise, _ = fn(pipeline, batch)
            times[label].append((wall, denoise))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(d for _, d in v)) for k, v in times.items()}
    return {
        "scenario": name,
        "sizes": sizes,
        "steps": steps,
        "padding": _padding_share(pipeline, batch),
        "max_diff": worst,
        **{f"{k} wall": v[0] for k, v in med.items()},
        **{f"{k} denoise": v[1] for k, v in med.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    header = ("scenario", "sizes", "padding", "packed wall s", "per-size wall s", "ratio", "packed denoise s")
    print("| " + " | ".join((*header, "per-size denoise s", "ratio")) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.scenarios:
        r = run_scenario(name, args.rounds, args.steps)
        sizes = " ".join(f"{w}x{h}" for w, h in r["sizes"])
        print(
            f"| {name} | {sizes} | {r['padding']:.0%} | {r['packed wall']:.3f} | {r['per-size wall']:.3f} | "
            f"{r['per-size wall'] / r['packed wall']:.2f}x | {r['packed denoise']:.3f} | {r['per-size denoise']:.3f} | "
            f"{r['per-size denoise'] / r['packed denoise']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
