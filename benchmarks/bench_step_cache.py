"""Step caches against quality: speed-up and PSNR / SSIM against the uncached output of the same seed, and the
demo model's colour-and-shape accuracy, per method at three settings (docs/step-caches.md).

    .venv/bin/python benchmarks/bench_step_cache.py [--model demo|36m|wan] [--steps 28] [--runs 3]
        [--threads 1] [--device cpu] [--size 256] [--prompts N] [--json FILE] [--plot FILE.png]

`--model demo` (the embedded demo model) generates its shapes test set (every colour x shape,
`demo/semantics.py`) and reports the colour-and-shape accuracy it is judged by; `36m` (the ~36M-parameter FLUX.1-style
random-weight checkpoint of `make-tiny --preset 36m`) and `wan` (the tiny Wan2.1 video checkpoint) are for speed:
their weights are random, so their PSNR says how far the cached output drifts, not how good it looks. Methods a
family cannot run (teacache outside FLUX.1) are left out and said so.

Each setting generates the prompts as ONE batch, rows deciding per row; the uncached batch runs beside it,
interleaved round by round so that load from other processes hits both alike. Speed-up is the median wall time of
the uncached batch over the cached one; `cpu x` is the same ratio of the process' CPU time, which other processes on
a shared machine disturb far less (run with `--threads 1` there); `denoise x` is the wall speed-up of the denoise
stage alone (text encoders and the VAE do not change with a cache). Finally a merged batch of 8 is checked against
the same 8 requests alone (largest pixel difference, in 1/255 steps), with its wall time against theirs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SETTINGS: dict[str, list[dict[str, Any]]] = {
    "fbcache": [{"threshold": 0.08}, {"threshold": 0.12}, {"threshold": 0.2, "max_cached_steps": 4}],
    "teacache": [{"threshold": 0.25}, {"threshold": 0.4}, {"threshold": 0.6, "max_cached_steps": 4}],
    "taylorseer": [
        {"refresh_interval": 2, "order": 1},
        {"refresh_interval": 3, "order": 2},
        {"refresh_interval": 4, "order": 2},
    ],
    "magcache": [{"threshold": 0.06}, {"threshold": 0.12}, {"threshold": 0.25, "max_cached_steps": 4}],
}
"""Three settings per method, from conservative to aggressive."""

SPEED_PROMPTS = (
    "a red circle in the top left",
    "a photo of a cat on a sofa",
    "a mountain lake at sunrise",
    "a blue square in the bottom right",
    "a city street at night in the rain",
    "a bowl of fruit on a wooden table",
    "a sailing boat on a calm sea",
    "a green triangle in the centre",
)
"""Prompts of the speed-only models (36m, wan); `--prompts N` takes the first N."""


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def ssim(a: Any, b: Any) -> float:
    """SSIM of two images, or the mean over the frames of two videos (arrays of frames)."""
    from skimage.metrics import structural_similarity

    if a.ndim == 4:
        return statistics.mean(ssim(x, y) for x, y in zip(a, b, strict=True))
    return float(structural_similarity(a, b, channel_axis=2, data_range=255))


def _accuracy(cases: list[Any], images: list[Any]) -> float | None:
    """The demo model's colour-and-shape accuracy; None for the speed-only models (no scenes)."""
    from diffuserve.demo import shapes

    if not cases or cases[0][0] is None:
        return None
    right = 0
    for (scene, _seed, _prompt), image in zip(cases, images, strict=True):
        shape, _ = shapes.best_shape(image, scene.position)
        right += shapes.dominant_colour(image) == scene.colour and shape == scene.shape
    return right / len(cases)


def _load(model: str, device: str) -> Any:
    """The benchmarked pipeline: the demo model, or a random-weight checkpoint built once into a temp folder."""
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint, ensure_default_model

    folder = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    if model == "demo":
        path = ensure_default_model(folder)
    elif model == "36m":
        path = build_tiny_checkpoint("flux", folder / "flux-36m", preset="36m")
    else:
        path = build_tiny_checkpoint("wan", folder / "wan")
    return load_pipeline(path, device=device)


def _cases(model: str, prompts: int | None) -> list[tuple[Any, int, str]]:
    """(scene or None, seed, prompt) per row of the test batch."""
    from diffuserve.demo import semantics

    if model == "demo":
        found = [(scene, seed, scene.prompt()) for scene, seed in semantics.cases_for((0,))]
    else:
        found = [(None, i, p) for i, p in enumerate(SPEED_PROMPTS)]
    return found[:prompts] if prompts else found


def _array(output: Any) -> Any:
    """An output row as uint8 pixels: HxWx3 for an image, FxHxWx3 for a video."""
    import numpy as np

    if output.videos:
        return np.stack([np.asarray(frame.convert("RGB")) for frame in output.videos[0]])
    return np.asarray(output.images[0].convert("RGB"))


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("demo", "36m", "wan"), default="demo", help="benchmarked checkpoint")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps")
    parser.add_argument("--runs", type=int, default=3, help="timed batches per setting (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--size", type=int, default=None, help="square side in pixels (default: the model's)")
    parser.add_argument("--prompts", type=int, default=None, help="rows of the test batch (default: all)")
    parser.add_argument("--merged", type=int, default=8, help="rows of the merged-vs-alone check (0: skip it)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--plot", default=None, help="also draw speed-up against PSNR per method to this PNG")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from diffuserve.config.step_cache import parse_step_cache, with_calibration
    from diffuserve.demo import shapes
    from diffuserve.sampling import SamplingParams
    from diffuserve.tools.calibrate_cache import calibrate

    pipeline = _load(args.model, args.device)
    d = pipeline.defaults
    side = args.size or (shapes.SIZE if args.model == "demo" else None)
    size = (side, side) if side else (d.width, d.height)
    cases = _cases(args.model, args.prompts)
    # MagCache's ratios from a calibration run on other prompts and seeds than the test set (calibrate-cache's own).
    ratios = Path(tempfile.mkdtemp(prefix="bench-cache-")) / "mag.json"
    ratios.write_text(json.dumps(calibrate(pipeline, steps=args.steps, size=size)))

    def params(cache: Any, rows: list[tuple[Any, int, str]]) -> list[SamplingParams]:
        return [
            SamplingParams(
                prompt=prompt,
                seed=seed,
                width=size[0],
                height=size[1],
                num_frames=d.num_frames,
                num_inference_steps=args.steps,
                guidance_scale=0.0 if args.model == "demo" else d.guidance_scale,
                negative_prompt=None if args.model == "demo" else d.negative_prompt,
                step_cache=cache,
            )
            for _scene, seed, prompt in rows
        ]

    def run(cache: Any) -> tuple[float, float, float, list[Any], list[Any]]:
        start, cpu = time.perf_counter(), time.process_time()
        result = pipeline.run(params(cache, cases))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        images = [_array(o) for o in result.outputs]
        return wall, cpu, result.stage_seconds.get("denoise", wall), images, [o.step_cache for o in result.outputs]

    run(None)  # warm-up
    methods = [m for m in SETTINGS if pipeline.step_cache_problem(m) is None]
    for method in sorted(set(SETTINGS) - set(methods)):
        print(f"{method}: left out, {pipeline.step_cache_problem(method)}")
    rows = [("uncached", None)] + [
        (f"{m} {json.dumps(o)}", with_calibration(parse_step_cache({"method": m, **o}), str(ratios)))
        for m in methods
        for o in SETTINGS[m]
    ]
    timed: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in rows}
    outputs: dict[str, tuple[list[Any], list[Any]]] = {}
    for i in range(args.runs):
        for name, cache in rows if i % 2 == 0 else rows[::-1]:
            wall, cpu, den, images, counts = run(cache)
            timed[name].append((wall, cpu, den))
            outputs[name] = (images, counts)
    report = _report(rows, timed, outputs, cases)
    report.update(model=args.model, steps=args.steps, size=list(size), rows=len(cases), runs=args.runs)
    if args.merged:
        merged = [(None, 100 + i, prompt) for i, (_s, _seed, prompt) in enumerate(_cases(args.model, None))]
        report["merged_vs_alone"] = _merged_vs_alone(pipeline, parse_step_cache, params, merged[: args.merged])
        print("merged batch vs the same requests alone:", report["merged_vs_alone"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        _plot(report, args.plot, f"{args.model}, {args.steps} steps, {size[0]}x{size[1]}")


def _plot(report: dict[str, Any], path: str, title: str) -> None:
    """Speed-up (wall) against PSNR, one line per method through its three settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in SETTINGS:
        points = [(r["psnr_db"], r["speedup"]) for r in report["settings"] if r["setting"].startswith(method)]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=method)
    ax.axhline(1.8, color="grey", linestyle=":", linewidth=1)
    ax.axvline(30, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("PSNR against uncached (dB)")
    ax.set_ylabel("speed-up (wall)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _report(
    rows: list[tuple[str, Any]],
    timed: dict[str, list[tuple[float, float, float]]],
    outputs: dict[str, Any],
    cases: list[Any],
) -> dict[str, Any]:
    med = {name: tuple(statistics.median(t[k] for t in timed[name]) for k in range(3)) for name, _ in rows}
    base_wall, base_cpu, base_den = med["uncached"]
    base_images = outputs["uncached"][0]
    print(
        f"{'setting':<52}{'wall s':>8}{'speed-up':>9}{'cpu x':>7}{'denoise x':>10}{'PSNR dB':>9}{'SSIM':>7}"
        f"{'acc':>6}{'reused':>8}"
    )
    report: dict[str, Any] = {"settings": []}
    for name, _cache in rows:
        images, counts = outputs[name]
        wall, cpu, den = med[name]
        value = statistics.mean(min(psnr(a, b), 99.0) for a, b in zip(images, base_images, strict=True))
        sim = statistics.mean(ssim(a, b) for a, b in zip(images, base_images, strict=True))
        reused = sum(c["reused_steps"] for c in counts if c) / max(
            1, sum(c["reused_steps"] + c["computed_steps"] for c in counts if c)
        )
        acc = _accuracy(cases, images)
        shown = "-" if acc is None else f"{acc:.0%}"
        print(
            f"{name:<52}{wall:>8.2f}{base_wall / wall:>8.2f}x{base_cpu / cpu:>6.2f}x{base_den / den:>9.2f}x"
            f"{value:>9.1f}{sim:>7.3f}{shown:>6}{reused:>8.0%}"
        )
        report["settings"].append(
            {
                "setting": name,
                "wall_s": wall,
                "speedup": base_wall / wall,
                "cpu_speedup": base_cpu / cpu,
                "denoise_speedup": base_den / den,
                "psnr_db": value,
                "ssim": sim,
                "accuracy": acc,
                "reused_share": reused,
            }
        )
    return report


def _merged_vs_alone(pipeline: Any, parse: Any, params: Any, rows: list[tuple[Any, int, str]]) -> dict[str, Any]:
    """A merged batch of rows with eight different fbcache thresholds (so rows hit and miss at the same step)
    against the same requests alone: the largest pixel difference and the wall time of each way."""
    import numpy as np

    batch = [
        p
        for i, row in enumerate(rows)
        for p in params(parse({"method": "fbcache", "threshold": 0.05 + 0.03 * i}), [row])
    ]
    start = time.perf_counter()
    merged = pipeline.run(batch).outputs
    merged_s, alone_s, worst = time.perf_counter() - start, 0.0, 0
    for request, output in zip(batch, merged, strict=True):
        start = time.perf_counter()
        alone = pipeline.run([request]).outputs[0]
        alone_s += time.perf_counter() - start
        a, b = (_array(x).astype(np.int16) for x in (output, alone))
        worst = max(worst, int(np.abs(a - b).max()))
    return {"rows": len(batch), "max_diff_255": worst, "merged_wall_s": merged_s, "alone_wall_s": alone_s}


if __name__ == "__main__":
    main()
