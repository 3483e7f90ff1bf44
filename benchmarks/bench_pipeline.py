"""Pipeline call time: direct diffusers.FluxPipeline vs the native pipeline (and, optionally, HTTP).

    .venv/bin/python benchmarks/bench_pipeline.py                       # tiny checkpoint, 64px, 4 steps
    .venv/bin/python benchmarks/bench_pipeline.py --base-url http://127.0.0.1:30010

Runs are interleaved (the order alternates every round) so that load from other processes on the
machine hits both sides alike; medians over `--runs` calls after `--warmup` calls. Targets (issue 2):
native / diffusers <= 0.95 and direct / HTTP round trip >= 0.85.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None, help="checkpoint (default: build the tiny one)")
    parser.add_argument("--preset", default="tiny", help="tiny-checkpoint preset when --model-path is not given")
    parser.add_argument("--size", type=int, default=64, help="image width and height in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per side first")
    parser.add_argument("--prompt", default="a cat surfing a wave at sunset")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--base-url", default=None, help="also time POST {base_url}/v1/images/generations")
    args = parser.parse_args(argv)
    if args.model_path is not None:
        _bench(args, args.model_path)
        return
    from diffuserve.models.tiny import build_tiny_checkpoint

    # The tiny checkpoint lives only as long as the run: nothing is left behind in the temp folder.
    with tempfile.TemporaryDirectory(prefix="bench-flux-") as tmp:
        _bench(args, build_tiny_checkpoint("flux", Path(tmp) / "flux", preset=args.preset))


def _bench(args: argparse.Namespace, model_path: Path) -> None:

    import torch
    from diffusers import FluxPipeline

    if args.threads:
        torch.set_num_threads(args.threads)

    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    native = load_pipeline(model_path)
    direct = FluxPipeline.from_pretrained(model_path, local_files_only=True)
    direct.set_progress_bar_config(disable=True)
    guidance = native.defaults.guidance_scale

    def run_direct(seed: int = 0) -> None:
        direct(
            args.prompt,
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(seed),
            # The checkpoint's declared T5 length, as the native pipeline uses (same work on both sides).
            max_sequence_length=native.adapter.max_sequence_length,
        )

    def run_native(seed: int = 0) -> None:
        params = SamplingParams(
            prompt=args.prompt,
            width=args.size,
            height=args.size,
            num_inference_steps=args.steps,
            guidance_scale=guidance,
            seed=seed,
        )
        native.run([params])

    sides: dict[str, Callable[[int], None]] = {"diffusers": run_direct, "native": run_native}
    client = None
    if args.base_url:
        import httpx

        client = httpx.Client(base_url=args.base_url, timeout=120)

        def run_http(seed: int = 0) -> None:
            body = {
                "prompt": args.prompt,
                "size": f"{args.size}x{args.size}",
                "num_inference_steps": args.steps,
                "seed": seed,
                "response_format": "b64_json",
            }
            response = client.post("/v1/images/generations", json=body)
            response.raise_for_status()

        sides["http"] = run_http

    names = list(sides)
    for i in range(args.warmup):
        for name in names:
            sides[name](i)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.runs):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(_time(lambda name=name, i=i: sides[name](i)))
    if client is not None:
        client.close()

    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        f"checkpoint: {model_path}  size={args.size}x{args.size} steps={args.steps} runs={args.runs} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'side':<12}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"{name:<12}{med[name] * 1e3:>12.2f}{q[0] * 1e3:>10.2f}{q[-1] * 1e3:>10.2f}")
    print(f"native / diffusers = {med['native'] / med['diffusers']:.3f}   (target <= 0.95)")
    if "http" in med:
        print(f"direct / HTTP round trip = {med['diffusers'] / med['http']:.3f}   (target >= 0.85)")
        print(f"native / HTTP round trip = {med['native'] / med['http']:.3f}")


if __name__ == "__main__":
    main()
