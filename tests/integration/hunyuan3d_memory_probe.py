"""Run one Hunyuan3D volume decode in this process and print its peak RSS as JSON (tests/integration/
test_hunyuan3d_memory.py runs it in a subprocess, so the figure is this decode's alone).

    python hunyuan3d_memory_probe.py model FOLDER OCTREE [MODEL_ID]   # the tiny model, end to end (pipe.run)
    python hunyuan3d_memory_probe.py synthetic dense|flashvdm OCTREE  # the decode machinery alone, cheap decoder

`synthetic` replaces the geometry decoder by a cheap function of the points whose |logit| < 0.95 everywhere, so
FlashVDM queries every point of every level (its worst case): what is measured is what the decode itself keeps.
"""

from __future__ import annotations

import io
import json
import resource
import sys
from pathlib import Path

import numpy as np
import torch


def rss_mib() -> int:
    """This process's peak RSS in MiB: VmHWM, the high-water mark of its own address space. (`getrusage`'s
    ru_maxrss is not: Linux carries the forking parent's peak across exec, so under a 1.5 GiB pytest it read 1.5 GiB
    before the decode began.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # no procfs: an upper bound


def shallow(queries: torch.Tensor, latents: torch.Tensor, attend=None) -> torch.Tensor:
    """A cheap stand-in decoder: a sphere whose occupancy values stay within +-0.5, so every point counts as near the
    surface and FlashVDM queries every point of every level (its worst case)."""
    return 0.5 * torch.tanh(queries.norm(dim=-1, keepdim=True) - 0.6)


def synthetic(decoder: str, octree: int) -> dict:
    from diffuserve.families.hunyuan3d.adapter import extract_surface
    from diffuserve.families.hunyuan3d.flashvdm import flashvdm_decode
    from diffuserve.families.hunyuan3d.vae import decode_volume

    decode = flashvdm_decode if decoder == "flashvdm" else decode_volume
    latents = torch.zeros(1, 4, 8)
    base = rss_mib()
    with torch.inference_mode():
        volume = decode(latents, shallow, bounds=1.01, resolution=octree, chunk_size=32000)
    mesh = extract_surface(volume[0].numpy(), level=0.0, box=1.01, resolution=octree)
    return {"base_mib": base, "peak_mib": rss_mib(), "faces": len(mesh.faces), "side": volume.shape[-1]}


def model(folder: str, octree: int, model_id: str | None) -> dict:
    from PIL import Image, ImageDraw

    from diffuserve.activation import estimate_bytes
    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    torch.set_num_threads(1)
    pipe = load_pipeline(Path(folder), model_id=model_id)
    image = Image.new("RGBA", (96, 80), (0, 0, 0, 0))
    ImageDraw.Draw(image).ellipse((20, 10, 70, 70), fill=(200, 50, 50, 255))
    png = io.BytesIO()
    image.save(png, "PNG")
    params = SamplingParams(
        image_inputs=(png.getvalue(),), num_inference_steps=2, guidance_scale=5.0, seed=1, octree_resolution=octree
    )
    base = rss_mib()
    mesh = pipe.run([params]).outputs[0].meshes[0]
    facts = pipe.describe_model().activation
    return {
        "base_mib": base,
        "peak_mib": rss_mib(),
        "faces": len(mesh.faces),
        "estimate_mib": estimate_bytes(facts, params) // 2**20,
        "vertices_finite": bool(np.isfinite(mesh.vertices).all()),
    }


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "synthetic":
        result = synthetic(sys.argv[2], int(sys.argv[3]))
    else:
        result = model(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    print(json.dumps(result))
