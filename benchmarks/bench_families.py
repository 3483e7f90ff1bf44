"""Every native family on its tiny checkpoint: native vs diffusers call time, and batched vs batch-1 throughput.

    .venv/bin/python benchmarks/bench_families.py                   # every family with a native adapter
    .venv/bin/python benchmarks/bench_families.py --families flux,sd3 --runs 20
    .venv/bin/python benchmarks/bench_families.py --families wan,wan2.2 --experts   # + Wan2.2 expert-offload bytes

Per family, side by side in one run: the native pipeline and the unmodified diffusers pipeline (our
`--backend diffusers`, which calls the diffusers pipeline class as a user would) load the same tiny folder;
their calls at 64px / 4 steps are interleaved (the order alternates every round, so load from other processes
hits both alike) and the medians compared. Then the native pipeline runs batches of 1 and of 8 requests
(interleaved) for outputs per second; image families batch 8, video families 4 (at the tiny size: 32x32, 5
frames; image-to-video rows each with their own random input image; edit families are not batched). Targets
(issues 8, 9): native / diffusers <= 1.0 for every family. `--experts` also reports, for the two-expert
Wan2.2 A14B checkpoint under
`--component-residency transformer=component-offload transformer_2=component-offload`, the bytes each request
moves per expert (from the transfer ledger).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _random_png(seed: int, size: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def bench_family(build: str, work: Path, *, size: int, steps: int, runs: int, warmup: int) -> dict[str, float]:
    from diffuserve import family_spec
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.sampling import build_sampling_params

    spec = family_spec.spec_for(family_spec.family_of_tiny(build))
    path = build_tiny_checkpoint(build, work / build)
    native = load_pipeline(path, backend="native")
    reference = load_pipeline(path, backend="diffusers")
    model = native.describe_model()
    is_edit = not spec.tasks & {"t2i", "t2v"}
    video = spec.output_kind == "video"
    extra = {"num_frames": 5} if video else {}
    if video:
        size = 32

    def image(i: int) -> tuple[bytes, ...]:
        """Edit families share one input image; image-to-video rows each get their own (the row's first frame)."""
        if not is_edit:
            return ()
        if not video:
            from diffuserve.tools.compat import _input_image

            return (_input_image(),)
        return (_random_png(i, size),)

    def request(i: int):
        return build_sampling_params(
            model,
            prompt=f"a red circle number {i}",
            seed=i,
            width=size,
            height=size,
            num_inference_steps=steps,
            image_inputs=image(i),
            **extra,
        )

    one = [request(0)]
    for _ in range(warmup):
        native.run(one)
        reference.run(one)
    native_times, diffusers_times = [], []
    for i in range(runs):
        pair = [(native, native_times), (reference, diffusers_times)]
        for pipe, times in pair if i % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            pipe.run(one)
            times.append(time.perf_counter() - start)
    result = {
        "native_ms": statistics.median(native_times) * 1000,
        "diffusers_ms": statistics.median(diffusers_times) * 1000,
    }
    result["ratio"] = result["native_ms"] / result["diffusers_ms"]
    if spec.supports_batching and (video or not is_edit):
        batch_size = 4 if video else 8
        eight = [request(i) for i in range(batch_size)]
        native.run(eight)
        b1, b8 = [], []
        for i in range(max(3, runs // 4)):
            order = [(one, b1), (eight, b8)]
            for batch, times in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                native.run(batch)
                times.append(time.perf_counter() - start)
        result["batch"] = batch_size
        result["b1_img_s"] = 1 / statistics.median(b1)
        result["b8_img_s"] = batch_size / statistics.median(b8)
        result["batch_gain"] = result["b8_img_s"] / result["b1_img_s"]
    return result


def expert_offload_bytes(work: Path, *, steps: int) -> dict[str, int]:
    """Bytes moved per request for each Wan2.2 A14B expert when both are component-offloaded."""
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency
    from diffuserve.sampling import build_sampling_params

    pipe = load_pipeline(build_tiny_checkpoint("wan2.2", work / "wan2.2-experts"))
    experts = ("transformer", "transformer_2")
    plan = DeploymentPlan(
        components={e: ComponentPlan(name=e, group="dit", mode=ResidencyMode.COMPONENT_OFFLOAD) for e in experts}
    )
    sizes = {e: sum(p.numel() * p.element_size() for p in pipe.components[e].parameters()) for e in experts}
    ledger = TransferLedger()
    pipe.residency = build_residency(plan, pipe.components, device="cpu", ledger=ledger)
    params = build_sampling_params(
        pipe.describe_model(),
        prompt="a kite",
        seed=0,
        width=32,
        height=32,
        num_frames=5,
        num_inference_steps=max(steps, 8),
        guidance_scale=3.0,
    )
    pipe.run([params])  # first request: settles the set-up moves
    ledger.begin_window()
    pipe.run([params])
    summary = ledger.window_summary()
    return {
        **{f"{e}_h2d": summary.bytes(e, "h2d") for e in experts},
        **{f"{e}_weights": sizes[e] for e in experts},
        "peak_device_bytes": summary.peak_device_bytes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--families", default=None, help="comma-separated make-tiny names (default: every native image build)"
    )
    parser.add_argument("--size", type=int, default=64, help="image width and height in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--runs", type=int, default=10, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per side first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--experts", action="store_true", help="also report Wan2.2 A14B expert-offload bytes per request"
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from diffuserve import family_spec

    builds = (
        [b.strip() for b in args.families.split(",")]
        if args.families
        else [name for spec in family_spec.all_specs().values() if spec.has_native for name in spec.tiny_builds]
    )
    print(
        f"{'family':<22}{'native ms':>11}{'diffusers ms':>14}{'ratio':>8}{'b1 out/s':>10}{'bN out/s':>10}"
        f"{'bN/b1':>8}{'N':>4}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        for build in builds:
            r = bench_family(build, Path(tmp), size=args.size, steps=args.steps, runs=args.runs, warmup=args.warmup)
            batch = (
                f"{r['b1_img_s']:>10.1f}{r['b8_img_s']:>10.1f}{r['batch_gain']:>8.2f}{r['batch']:>4}"
                if "batch_gain" in r
                else f"{'-':>10}{'-':>10}{'-':>8}{'-':>4}"
            )
            print(f"{build:<22}{r['native_ms']:>11.1f}{r['diffusers_ms']:>14.1f}{r['ratio']:>8.2f}{batch}", flush=True)
        if args.experts:
            moved = expert_offload_bytes(Path(tmp), steps=args.steps)
            print(
                "Wan2.2 A14B, both experts component-offloaded, bytes per request: "
                + ", ".join(f"{k}={v}" for k, v in moved.items())
            )


if __name__ == "__main__":
    main()
