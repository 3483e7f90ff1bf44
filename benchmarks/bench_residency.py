"""Residency modes side by side: bytes moved per request, peak device bytes, latency vs resident.

    .venv/bin/python benchmarks/bench_residency.py [--presets tiny,36m] [--steps 4] [--size 64] [--rounds 3]

Builds the tiny FLUX checkpoints (`tiny`: ~72k-parameter transformer; `36m`: ~36M) into a temp
dir, loads the native pipeline, and runs one request per mode, interleaving the modes round by
round so machine drift hits them alike. Every mode applies to all four components (transformer,
both text encoders, VAE). Figures come from the TransferLedger: bytes moved during the request and
the highest bytes attached on the device during it.

On a CPU-only machine the host is the device: nothing is copied, so the latency column shows only
the runtime's hook and bookkeeping overhead, not transfer cost. On CUDA it would include the copies.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime, ResidencyMode

COMPONENTS = {"transformer": "dit", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder", "vae": "vae"}


@dataclass
class Variant:
    """One column of the table: a mode applied to every component (with layer-wise settings)."""

    label: str = "resident"
    mode: ResidencyMode = ResidencyMode.RESIDENT
    prefetch_size: int = 1
    resident_layers: int = 0
    """Resident set of each layer-wise component (clamped to its layer count)."""
    lifetime: Lifetime = Lifetime.FORWARD


VARIANTS = [
    Variant("resident"),
    Variant("component-offload", ResidencyMode.COMPONENT_OFFLOAD),
    Variant("snapshot-offload", ResidencyMode.SNAPSHOT_OFFLOAD),
    Variant("layerwise P=1", ResidencyMode.LAYERWISE_OFFLOAD),
    Variant("layerwise P=2", ResidencyMode.LAYERWISE_OFFLOAD, prefetch_size=2),
    Variant("layerwise R=2 forward", ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=2),
    Variant("layerwise R=2 permanent", ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=2, lifetime=Lifetime.PERMANENT),
]


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    bytes_moved: int = 0
    peak_bytes: int = 0


def _plan(variant: Variant, pipeline) -> DeploymentPlan:
    from diffuserve.runtime.layerwise import default_layer_specs, expand_layers

    comps = {}
    for name, group in COMPONENTS.items():
        module = pipeline.components[name]
        resident = 0
        if variant.mode is ResidencyMode.LAYERWISE_OFFLOAD:
            specs = default_layer_specs(name, module) or []
            resident = min(variant.resident_layers, len(expand_layers(name, module, specs)))
        comps[name] = ComponentPlan(
            name=name,
            group=group,
            mode=variant.mode,
            prefetch_size=variant.prefetch_size,
            resident_layers=resident,
            lifetime=variant.lifetime,
        )
    return DeploymentPlan(components=comps)


def bench_preset(preset: str, args: argparse.Namespace, workdir: Path) -> dict[str, Result]:
    import torch

    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.pipelines.base import AllResident
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency
    from diffuserve.sampling import SamplingParams

    path = build_tiny_checkpoint("flux", workdir / f"flux-{preset}", preset=preset)
    pipe = load_pipeline(path, device="cpu", dtype="float32")
    params = SamplingParams(
        prompt="a lighthouse at dusk",
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        seed=1,
    )
    n_params = sum(p.numel() for p in pipe.components["transformer"].parameters())
    print(f"\n[{preset}] transformer parameters: {n_params / 1e6:.2f}M, {args.size}px, {args.steps} steps")
    pipe.run([params])  # warm-up (allocator, caches)
    results = {v.label: Result() for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            ledger = TransferLedger()
            pipe.residency = build_residency(
                _plan(variant, pipe), pipe.components, device=torch.device("cpu"), ledger=ledger
            )
            try:
                ledger.reset_peak()
                ledger.begin_window()
                start = time.perf_counter()
                pipe.run([params])
                elapsed = time.perf_counter() - start
                summary = ledger.window_summary()
            finally:
                pipe.residency.close()
                pipe.residency = AllResident()
            res = results[variant.label]
            res.seconds.append(elapsed)
            res.bytes_moved = summary.bytes(direction="h2d") + summary.bytes(direction="d2h")
            res.peak_bytes = summary.peak_device_bytes
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,36m", help="comma-separated tiny checkpoint presets")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    ap.add_argument("--size", type=int, default=64, help="image width and height in pixels")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the latency is the fastest")
    args = ap.parse_args()
    import torch

    device = "CUDA" if torch.cuda.is_available() else "CPU (host = device: latency shows hook overhead only)"
    print(f"device: {device}; this script measures the CPU path")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        table = {p: bench_preset(p, args, Path(tmp)) for p in presets}
    mib = 1 << 20
    head = f"{'mode':<26}" + "".join(f"| {p + ' moved MiB':>16} {'peak MiB':>9} {'lat/res':>8} " for p in presets)
    print("\n" + head)
    print("-" * len(head))
    for v in VARIANTS:
        row = f"{v.label:<26}"
        for p in presets:
            r = table[p][v.label]
            # The fastest round: on a shared machine, interference only ever adds time.
            base = min(table[p]["resident"].seconds)
            row += f"| {r.bytes_moved / mib:>16.3f} {r.peak_bytes / mib:>9.3f} {min(r.seconds) / base:>8.2f} "
        print(row)
    print(
        "\nmoved = h2d + d2h bytes per request (frees of kept host copies cost no copy); peak = most bytes "
        "attached on the device during the request, per the TransferLedger; lat/res = fastest-round latency ÷ "
        "resident fastest round. On CPU the latency ratio shows only hook/bookkeeping overhead."
    )


if __name__ == "__main__":
    main()
