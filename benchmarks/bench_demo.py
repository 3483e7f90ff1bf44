"""Speed of the embedded demo model next to the random tiny model (native pipeline, in-process).

    .venv/bin/python benchmarks/bench_demo.py [--size 64] [--steps 4] [--runs 20] [--threads 1]

Both checkpoints run the same native FLUX pipeline at the same size and steps, batch 1 and batch 8,
interleaved round by round (the order alternates) so load from other processes hits both alike.
Prints median ms per call and images/s per model and batch size, and demo / tiny.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="image width and height in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--runs", type=int, default=20, help="timed calls per model and batch size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from diffuserve.engine.request import SamplingParams
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint, ensure_default_model

    paths = {
        "tiny (random)": build_tiny_checkpoint("flux", Path(tempfile.mkdtemp(prefix="bench-flux-")), preset="tiny"),
        "demo (trained)": ensure_default_model(Path(tempfile.mkdtemp(prefix="bench-demo-"))),
    }
    pipelines = {name: load_pipeline(path) for name, path in paths.items()}

    def call(name: str, batch: int, seed: int) -> float:
        params = [
            SamplingParams(
                prompt="a red circle in the top left",
                width=args.size,
                height=args.size,
                num_inference_steps=args.steps,
                guidance_scale=0.0,
                seed=seed + j,
            )
            for j in range(batch)
        ]
        start = time.perf_counter()
        pipelines[name].run(params)
        return time.perf_counter() - start

    sides = [(name, batch) for batch in (1, 8) for name in pipelines]
    for i in range(args.warmup):
        for name, batch in sides:
            call(name, batch, i)
    times: dict[tuple[str, int], list[float]] = {side: [] for side in sides}
    for i in range(args.runs):
        for side in sides if i % 2 == 0 else sides[::-1]:
            times[side].append(call(*side, i))
    print(f"size={args.size}x{args.size} steps={args.steps} runs={args.runs} threads={torch.get_num_threads()}")
    print(f"{'model':<16}{'batch':>6}{'median ms':>12}{'images/s':>10}")
    med = {side: statistics.median(v) for side, v in times.items()}
    for (name, batch), m in med.items():
        print(f"{name:<16}{batch:>6}{m * 1e3:>12.1f}{batch / m:>10.1f}")
    for batch in (1, 8):
        print(f"batch {batch}: demo / tiny time = {med[('demo (trained)', batch)] / med[('tiny (random)', batch)]:.2f}")


if __name__ == "__main__":
    main()
