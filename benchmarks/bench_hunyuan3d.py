"""Hunyuan3D-2 shape generation per stage: DiT steps, volume decode, marching cubes and GLB export, at octree
128 and 256, one job alone vs a batch of 4 jobs (one DiT batch, one chunked volume decode), on the tiny release.

    .venv/bin/python benchmarks/bench_hunyuan3d.py                       # octree 128,256; steps 5; 2 repeats
    .venv/bin/python benchmarks/bench_hunyuan3d.py --octree 128 --steps 2 --repeats 1 --device cuda
    .venv/bin/python benchmarks/bench_hunyuan3d.py --variant hunyuan3d-dit-v2-0-turbo   # FlashVDM (turbo's default)
    .venv/bin/python benchmarks/bench_hunyuan3d.py --variant hunyuan3d-dit-v2-0-turbo --volume-decoder dense

The tiny DiT and decoder are a few hundred kilobytes, so the figures show where the time of the *recipe* goes
(the volume decode grows with octree^3 and with the rows; marching cubes and export with the surface), not what
the published weights cost. Prints one line per (octree, batch) with milliseconds per stage: totals for the batch
and per job.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import tempfile
import time
from pathlib import Path


def object_png() -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (96, 80), (0, 0, 0, 0))
    ImageDraw.Draw(image).ellipse((20, 10, 70, 70), fill=(200, 50, 50, 255))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def measure(pipe, octree: int, batch: int, steps: int) -> dict[str, float]:
    """Seconds per stage for one pipeline call of `batch` jobs (export: every job's GLB)."""
    from diffuserve.media.meshes import encode_mesh
    from diffuserve.sampling import SamplingParams

    params = [
        SamplingParams(
            image_inputs=(object_png(),),
            num_inference_steps=steps,
            guidance_scale=5.0,
            seed=s,
            octree_resolution=octree,
        )
        for s in range(batch)
    ]
    result = pipe.run(params)
    stages = dict(result.stage_seconds)
    started = time.perf_counter()
    for output in result.outputs:
        mesh = output.meshes[0]
        if mesh.error is None:
            encode_mesh(mesh.vertices, mesh.faces, "glb")
    stages["export"] = time.perf_counter() - started
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--octree", default="128,256", help="Comma-separated octree resolutions.")
    parser.add_argument("--steps", type=int, default=5, help="DiT steps per job.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per point; the fastest total is kept.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint", default=None, help="A Hunyuan3D-2 folder (default: build the tiny release).")
    parser.add_argument("--variant", default=None, help="Subfolder / --model-id of the release (default: 2.0).")
    parser.add_argument(
        "--volume-decoder", default="auto", choices=("auto", "dense", "flashvdm"), help="auto: FlashVDM for turbo."
    )
    ns = parser.parse_args()

    import torch

    from diffuserve.families.hunyuan3d.tiny import build_hunyuan3d
    from diffuserve.models.loader import load_pipeline

    folder = Path(ns.checkpoint) if ns.checkpoint else Path(tempfile.mkdtemp()) / "hunyuan3d-tiny"
    if ns.checkpoint is None:
        build_hunyuan3d(folder)
    pipe = load_pipeline(folder, model_id=ns.variant, device=ns.device)
    pipe.settings = dataclasses.replace(pipe.settings, volume_decoder=ns.volume_decoder)
    measure(pipe, 32, 1, 1)  # warm-up
    order = ("encode", "denoise", "volume_decode", "marching_cubes", "export")
    print(
        f"variant={pipe.variant} volume_decoder={pipe.volume_decoder} device={ns.device} "
        f"threads={torch.get_num_threads()} steps={ns.steps} chunk={pipe.settings.chunk_size}"
    )
    print(f"{'octree':>6} {'jobs':>4} " + " ".join(f"{s:>14}" for s in order) + f" {'total':>9} {'per job':>9}")
    for octree in (int(x) for x in ns.octree.split(",")):
        for batch in (1, 4):
            runs = [measure(pipe, octree, batch, ns.steps) for _ in range(ns.repeats)]
            best = min(runs, key=lambda r: sum(r.values()))
            total = sum(best.get(s, 0.0) for s in order)
            print(
                f"{octree:>6} {batch:>4} "
                + " ".join(f"{best.get(s, 0.0) * 1000:>14.1f}" for s in order)
                + f" {total * 1000:>9.1f} {total * 1000 / batch:>9.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
