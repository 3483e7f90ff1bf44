"""Every native family on its tiny checkpoint: native vs diffusers call time, and batch-8 vs batch-1 throughput.

    .venv/bin/python benchmarks/bench_families.py                   # every image family with a native adapter
    .venv/bin/python benchmarks/bench_families.py --families flux,sd3 --runs 20

Per family, side by side in one run: the native pipeline and the unmodified diffusers pipeline (our
`--backend diffusers`, which calls the diffusers pipeline class as a user would) load the same tiny folder;
their calls at 64px / 4 steps are interleaved (the order alternates every round, so load from other processes
hits both alike) and the medians compared. Then the native pipeline runs batches of 1 and of 8 requests
(interleaved) for images per second. Target (issue 8): native / diffusers <= 1.0 for every family.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def bench_family(build: str, work: Path, *, size: int, steps: int, runs: int, warmup: int) -> dict[str, float]:
    from diffuserve import families
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.sampling import build_sampling_params

    spec = families.spec_for(families.family_of_tiny(build))
    path = build_tiny_checkpoint(build, work / build)
    native = load_pipeline(path, backend="native")
    reference = load_pipeline(path, backend="diffusers")
    model = native.describe_model()
    is_edit = "t2i" not in spec.tasks
    image = None
    if is_edit:
        from diffuserve.compat import _input_image

        image = (_input_image(),)

    def request(i: int):
        return build_sampling_params(model, prompt=f"a red circle number {i}", seed=i, width=size, height=size,
                                     num_inference_steps=steps, image_inputs=image or ())

    one = [request(0)]
    for _ in range(warmup):
        native.run(one)
        reference.run(one)
    native_times, diffusers_times = [], []
    for i in range(runs):
        pair = [(native, native_times), (reference, diffusers_times)]
        for pipe, times in (pair if i % 2 == 0 else pair[::-1]):
            start = time.perf_counter()
            pipe.run(one)
            times.append(time.perf_counter() - start)
    result = {"native_ms": statistics.median(native_times) * 1000,
              "diffusers_ms": statistics.median(diffusers_times) * 1000}
    result["ratio"] = result["native_ms"] / result["diffusers_ms"]
    if spec.supports_batching and not is_edit:
        eight = [request(i) for i in range(8)]
        native.run(eight)
        b1, b8 = [], []
        for i in range(max(3, runs // 4)):
            order = [(one, b1), (eight, b8)]
            for batch, times in (order if i % 2 == 0 else order[::-1]):
                start = time.perf_counter()
                native.run(batch)
                times.append(time.perf_counter() - start)
        result["b1_img_s"] = 1 / statistics.median(b1)
        result["b8_img_s"] = 8 / statistics.median(b8)
        result["batch_gain"] = result["b8_img_s"] / result["b1_img_s"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=None, help="comma-separated make-tiny names (default: every native image build)")
    parser.add_argument("--size", type=int, default=64, help="image width and height in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--runs", type=int, default=10, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per side first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from diffuserve import families

    builds = ([b.strip() for b in args.families.split(",")] if args.families else
              [name for spec in families.all_specs().values() if spec.has_native and spec.output_kind == "image"
               for name in spec.tiny_builds])
    print(f"{'family':<22}{'native ms':>11}{'diffusers ms':>14}{'ratio':>8}{'b1 img/s':>10}{'b8 img/s':>10}{'b8/b1':>8}")
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        for build in builds:
            r = bench_family(build, Path(tmp), size=args.size, steps=args.steps, runs=args.runs, warmup=args.warmup)
            batch = (f"{r['b1_img_s']:>10.1f}{r['b8_img_s']:>10.1f}{r['batch_gain']:>8.2f}"
                     if "batch_gain" in r else f"{'-':>10}{'-':>10}{'-':>8}")
            print(f"{build:<22}{r['native_ms']:>11.1f}{r['diffusers_ms']:>14.1f}{r['ratio']:>8.2f}{batch}", flush=True)


if __name__ == "__main__":
    main()
