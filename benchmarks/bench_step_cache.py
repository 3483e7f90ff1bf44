"""Step caches against quality: speed-up and PSNR / SSIM against the uncached image of the same seed, and the
demo model's colour-and-shape accuracy, per method at three settings (docs/step-caches.md).

    .venv/bin/python benchmarks/bench_step_cache.py [--steps 28] [--runs 3] [--threads 1] [--device cpu]
        [--json results/step_cache.json]

Each setting generates the demo model's shapes test set (every colour x shape, `demo/semantics.py`) as ONE batch,
rows deciding per row; the uncached batch runs beside it, interleaved round by round so that load from other
processes hits both alike. Speed-up is the median wall time of the uncached batch over the cached one; `cpu x` is
the same ratio of the process' CPU time, which other processes on a shared machine disturb far less (run with
`--threads 1` there); `denoise x` is the wall speed-up of the denoise stage alone (text encoders and the VAE do not
change with a cache). Finally a merged
batch of 8 is checked against the same 8 requests alone (largest pixel difference, in 1/255 steps).
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


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def ssim(a: Any, b: Any) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, channel_axis=2, data_range=255))


def _accuracy(cases: list[Any], images: list[Any]) -> float:
    from diffuserve.demo import shapes

    right = 0
    for (scene, _seed), image in zip(cases, images, strict=True):
        shape, _ = shapes.best_shape(image, scene.position)
        right += shapes.dominant_colour(image) == scene.colour and shape == scene.shape
    return right / len(cases)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=28, help="denoising steps")
    parser.add_argument("--runs", type=int, default=3, help="timed batches per setting (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--plot", default=None, help="also draw speed-up against PSNR per method to this PNG")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from diffuserve.config.step_cache import parse_step_cache, with_calibration
    from diffuserve.demo import semantics, shapes
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import ensure_default_model
    from diffuserve.sampling import SamplingParams
    from diffuserve.tools.calibrate_cache import calibrate

    pipeline = load_pipeline(ensure_default_model(Path(tempfile.mkdtemp(prefix="bench-cache-"))), device=args.device)
    cases = semantics.cases_for((0,))
    # MagCache's ratios from a calibration run on other prompts and seeds than the test set (calibrate-cache's own).
    ratios = Path(tempfile.mkdtemp(prefix="bench-cache-")) / "mag.json"
    ratios.write_text(json.dumps(calibrate(pipeline, steps=args.steps)))

    def batch(cache: Any) -> list[SamplingParams]:
        return [
            SamplingParams(
                prompt=scene.prompt(),
                seed=seed,
                width=shapes.SIZE,
                height=shapes.SIZE,
                num_inference_steps=args.steps,
                guidance_scale=0.0,
                step_cache=cache,
            )
            for scene, seed in cases
        ]

    def run(cache: Any) -> tuple[float, float, float, list[Any], list[Any]]:
        start, cpu = time.perf_counter(), time.process_time()
        result = pipeline.run(batch(cache))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        images = [np.asarray(o.images[0].convert("RGB")) for o in result.outputs]
        return wall, cpu, result.stage_seconds.get("denoise", wall), images, [o.step_cache for o in result.outputs]

    run(None)  # warm-up
    rows = [("uncached", None)] + [
        (f"{m} {json.dumps(o)}", with_calibration(parse_step_cache({"method": m, **o}), str(ratios)))
        for m, options in SETTINGS.items()
        for o in options
    ]
    walls: dict[str, list[float]] = {name: [] for name, _ in rows}
    cpus: dict[str, list[float]] = {name: [] for name, _ in rows}
    denoise: dict[str, list[float]] = {name: [] for name, _ in rows}
    outputs: dict[str, tuple[list[Any], list[Any]]] = {}
    for i in range(args.runs):
        for name, cache in rows if i % 2 == 0 else rows[::-1]:
            wall, cpu, den, images, counts = run(cache)
            walls[name].append(wall)
            cpus[name].append(cpu)
            denoise[name].append(den)
            outputs[name] = (images, counts)
    report = _report(rows, walls, cpus, denoise, outputs, cases)
    report["merged_vs_alone_max_diff"] = _merged_vs_alone(pipeline, parse_step_cache, SamplingParams, args.steps)
    print(f"merged batch of 8 vs alone, largest pixel difference: {report['merged_vs_alone_max_diff']}/255")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        _plot(report, args.plot)


def _plot(report: dict[str, Any], path: str) -> None:
    """Speed-up (wall) against PSNR, one line per method through its three settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in SETTINGS:
        points = [(r["psnr_db"], r["speedup"]) for r in report["settings"] if r["setting"].startswith(method)]
        ax.plot(*zip(*points, strict=True), marker="o", label=method)
    ax.axhline(1.8, color="grey", linestyle=":", linewidth=1)
    ax.axvline(30, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("PSNR against uncached (dB)")
    ax.set_ylabel("speed-up (wall)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _report(
    rows: list[tuple[str, Any]],
    walls: dict[str, list[float]],
    cpus: dict[str, list[float]],
    denoise: dict[str, list[float]],
    outputs: dict[str, Any],
    cases: list[Any],
) -> dict[str, Any]:
    import statistics as st

    med = {name: (st.median(walls[name]), st.median(cpus[name]), st.median(denoise[name])) for name, _ in rows}
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
        print(
            f"{name:<52}{wall:>8.2f}{base_wall / wall:>8.2f}x{base_cpu / cpu:>6.2f}x{base_den / den:>9.2f}x"
            f"{value:>9.1f}{sim:>7.3f}{acc:>6.0%}{reused:>8.0%}"
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


def _merged_vs_alone(pipeline: Any, parse: Any, params_cls: Any, steps: int) -> int:
    """A merged batch of 8 rows with different thresholds against the same 8 requests alone."""
    import numpy as np

    from diffuserve.demo import semantics, shapes

    cases = semantics.cases_for((1,))[:8]
    batch = [
        params_cls(
            prompt=scene.prompt(),
            seed=seed + i,
            width=shapes.SIZE,
            height=shapes.SIZE,
            num_inference_steps=steps,
            guidance_scale=0.0,
            step_cache=parse({"method": "fbcache", "threshold": 0.05 + 0.03 * i}),
        )
        for i, (scene, seed) in enumerate(cases)
    ]
    merged = pipeline.run(batch).outputs
    worst = 0
    for params, output in zip(batch, merged, strict=True):
        alone = pipeline.run([params]).outputs[0]
        a, b = (np.asarray(x.images[0]).astype(np.int16) for x in (output, alone))
        worst = max(worst, int(np.abs(a - b).max()))
    return worst


if __name__ == "__main__":
    main()
