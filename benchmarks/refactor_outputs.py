"""Outputs of the native pipeline on tiny checkpoints, saved to compare two trees byte for byte (a refactor).

    cd BEFORE && PYTHONPATH=BEFORE/src .venv/bin/python benchmarks/refactor_outputs.py save before.npz --checkpoints DIR
    cd AFTER  && PYTHONPATH=AFTER/src  .venv/bin/python benchmarks/refactor_outputs.py save after.npz --checkpoints DIR
    .venv/bin/python benchmarks/refactor_outputs.py compare before.npz after.npz

`save` builds each family's tiny checkpoint into DIR once (both trees then load the same folders) and runs one batch
per family: two requests (n=2 and n=1, different prompts and seeds), with CFG where the family runs it, one torch
thread. Every output row (image, video frames, LTX-2's sound) is kept as an array. `compare` prints how many arrays are
byte-equal and names the others; it exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

CASES: dict[str, dict[str, Any]] = {
    "flux": {"width": 64, "height": 64, "num_inference_steps": 3, "guidance_scale": 3.5},
    "qwen-image": {
        "width": 64,
        "height": 64,
        "num_inference_steps": 3,
        "true_cfg_scale": 4.0,
        "negative_prompt": "blur",
    },
    "sd3": {"width": 64, "height": 64, "num_inference_steps": 3, "guidance_scale": 5.0},
    "z-image": {"width": 64, "height": 64, "num_inference_steps": 3, "guidance_scale": 2.0},
    "sana": {"width": 64, "height": 64, "num_inference_steps": 3, "guidance_scale": 4.5},
    "flux2-klein": {"width": 64, "height": 64, "num_inference_steps": 3, "guidance_scale": 4.0},
    "wan": {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3, "guidance_scale": 5.0},
    "ltx2": {"width": 32, "height": 32, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 3.0},
}
"""Tiny checkpoint (a `make-tiny --family` name) -> the request fields of its batch."""


def save(path: Path, checkpoints: Path) -> None:
    import torch

    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.sampling import SamplingParams

    torch.set_num_threads(1)
    checkpoints.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for name, fields in CASES.items():
        folder = checkpoints / name
        if not folder.exists():
            build_tiny_checkpoint(name, folder)
        batch = [
            SamplingParams(prompt="a red fox in snow", seed=7, n=2, **fields),
            SamplingParams(prompt="a kite", seed=3, **fields),
        ]
        for i, output in enumerate(load_pipeline(folder).run(batch).outputs):
            for j, row in enumerate(output.images or output.videos):
                frames = row if isinstance(row, list) else [row]
                arrays[f"{name}/{i}/{j}"] = np.stack([np.asarray(frame) for frame in frames])
            if output.audios:
                arrays[f"{name}/{i}/audio"] = np.stack([np.asarray(wave) for wave in output.audios])
        print(f"{name}: {len(batch)} requests run", flush=True)
    np.savez(path, **arrays)


def compare(first: Path, second: Path) -> int:
    a, b = np.load(first), np.load(second)
    keys = sorted(set(a.files) | set(b.files))
    differ = [
        k
        for k in keys
        if k not in a.files
        or k not in b.files
        or a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or a[k].tobytes() != b[k].tobytes()
    ]
    print(f"{len(keys) - len(differ)} of {len(keys)} arrays byte-equal" + (f"; differ: {differ}" if differ else ""))
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    saving = sub.add_parser("save", help="run the batches with this tree's code and save the outputs")
    saving.add_argument("output", type=Path, help="the .npz file to write")
    saving.add_argument("--checkpoints", type=Path, required=True, help="folder of the tiny checkpoints (built once)")
    comparing = sub.add_parser("compare", help="compare two saved runs byte for byte")
    comparing.add_argument("first", type=Path)
    comparing.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.output, args.checkpoints)
        return 0
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
