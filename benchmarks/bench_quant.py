"""Online quantization on CPU: resident DiT bytes, pipeline call time and PSNR per method (docs/quantization.md).

    .venv/bin/python benchmarks/bench_quant.py                    # the 36M FLUX.1-style checkpoint, 256 px, 4 steps
    .venv/bin/python benchmarks/bench_quant.py --model-path CKPT --size 512 --threads 1

One pipeline is loaded; each method quantizes its DiT in place and is put back after (so every method runs on the
same weights and the same unquantized reference). Calls are interleaved round by round across the methods, so load
from other processes on the machine hits them alike; medians over `--runs` calls after one warm-up call each.
Goals (issue 28): int8 / fp8 DiT bytes <= 0.55x of the unquantized DiT at its load dtype; int8-dynamic >= 1.3x the
unquantized call; weight-only methods no worse than 1.15x slower; PSNR >= 30 dB against the unquantized image.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

METHODS = ("fp8", "int8", "int8-dynamic")


def _nbytes(module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@contextlib.contextmanager
def _quantized(pipe, method: str | None) -> Iterator[None]:
    import torch

    from diffuserve import family_spec
    from diffuserve.quant.apply import quantize_components

    if method is None:
        yield
        return
    dit = pipe.components["transformer"]
    before = {(p, n): c for p in dit.modules() for n, c in p.named_children() if type(c) is torch.nn.Linear}
    quantize_components(pipe.components, {"transformer": (method, family_spec.spec_for(pipe.family).quant_keep)}, "cpu")
    try:
        yield
    finally:
        for (parent, name), child in before.items():
            setattr(parent, name, child)


def _bench(args: argparse.Namespace, model_path: Path) -> None:
    import torch

    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(model_path, dtype=args.dtype)
    params = SamplingParams(
        prompt=args.prompt, seed=0, width=args.size, height=args.size, num_inference_steps=args.steps
    )

    def call() -> np.ndarray:
        with torch.inference_mode():
            return np.asarray(pipe.run([params]).outputs[0].images[0].convert("RGB")).astype(np.float64)

    labels = ["none", *METHODS]
    times: dict[str, list[float]] = {label: [] for label in labels}
    images, sizes = {}, {}
    for label in labels:  # warm-up, image and bytes
        with _quantized(pipe, None if label == "none" else label):
            images[label] = call()
            sizes[label] = _nbytes(pipe.components["transformer"])
    for round_ in range(args.runs):
        order = labels if round_ % 2 == 0 else labels[::-1]
        for label in order:
            with _quantized(pipe, None if label == "none" else label):
                start = time.perf_counter()
                call()
                times[label].append(time.perf_counter() - start)
    base = statistics.median(times["none"])
    print(
        f"{model_path.name}: {args.size}px, {args.steps} steps, --dtype {args.dtype}, {torch.get_num_threads()} threads"
    )
    print(f"{'method':14}{'DiT MiB':>9}{'x bytes':>9}{'call s':>9}{'speed-up':>10}{'PSNR dB':>9}")
    for label in labels:
        mse = float(((images[label] - images["none"]) ** 2).mean())
        psnr = "-" if label == "none" else f"{10 * np.log10(255**2 / mse) if mse else 99:.1f}"
        median = statistics.median(times[label])
        print(
            f"{label:14}{sizes[label] / 2**20:9.1f}{sizes[label] / sizes['none']:9.2f}{median:9.3f}"
            f"{base / median:9.2f}x{psnr:>9}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None, help="checkpoint (default: build the 36M one)")
    parser.add_argument("--size", type=int, default=256, help="image width and height in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per method")
    parser.add_argument("--dtype", default="float32", help="compute dtype (the CPU default is float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--prompt", default="a red circle on a blue square")
    args = parser.parse_args(argv)
    if args.model_path is not None:
        _bench(args, args.model_path)
        return
    from diffuserve.models.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        _bench(args, build_tiny_checkpoint("flux", Path(tmp) / "flux-36m", preset="36m"))


if __name__ == "__main__":
    main()
