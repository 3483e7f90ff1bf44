"""The cost of a ControlNet row against a plain row (issue 32), on a tiny FLUX.1 checkpoint with a tiny ControlNet.

    .venv/bin/python benchmarks/bench_controlnet.py [--preset tiny] [--size 64] [--steps 4] [--rows 4]
        [--rounds 5] [--threads 1] [--controlnet-layers 1] [--json results/controlnet.json]

Builds the checkpoint (`build_tiny_checkpoint("flux", preset)`) and a FluxControlNetModel for it
(`families/flux/controlnet.py` `build_tiny_flux_controlnet`, `--controlnet-layers` double blocks and one single
block, as InstantX's FLUX.1 ControlNets are shallower than the DiT), then times one call of `--rows` rows:
plain rows, ControlNet rows, and half of each in one batch. Every variant runs once per round, the order alternating
round by round; medians of wall and process CPU time are reported, per row.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path


def _png(size: int) -> bytes:
    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--controlnet-layers", type=int, default=1)
    parser.add_argument("--json", default=None)
    ns = parser.parse_args()

    import torch

    from diffuserve.families.flux.controlnet import build_tiny_flux_controlnet
    from diffuserve.models.controlnets import install_controlnets
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.sampling import ControlRequest, SamplingParams

    torch.set_num_threads(ns.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-controlnet-"))
    base = build_tiny_checkpoint("flux", root / "flux", preset=ns.preset)
    net = build_tiny_flux_controlnet(base, root / "controlnet", num_layers=ns.controlnet_layers)
    pipe = load_pipeline(base)
    install_controlnets(pipe, [str(net)])
    control = ControlRequest(_png(ns.size))
    common = {"width": ns.size, "height": ns.size, "num_inference_steps": ns.steps}

    def rows(kind: str) -> list[SamplingParams]:
        with_control = {"plain": 0, "control": ns.rows, "mixed": ns.rows // 2}[kind]
        return [
            SamplingParams(prompt=f"row {i}", seed=i, control=control if i < with_control else None, **common)
            for i in range(ns.rows)
        ]

    kinds = ["plain", "control", "mixed"]
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    pipe.run(rows("control"))  # warm-up
    for r in range(ns.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            batch = rows(kind)
            wall, cpu = time.perf_counter(), time.process_time()
            pipe.run(batch)
            times[kind].append((time.perf_counter() - wall, time.process_time() - cpu))
    result = {
        kind: {
            "wall_ms_per_row": 1000 * statistics.median(w for w, _ in t) / ns.rows,
            "cpu_ms_per_row": 1000 * statistics.median(c for _, c in t) / ns.rows,
        }
        for kind, t in times.items()
    }
    plain = result["plain"]["cpu_ms_per_row"]
    for kind in kinds:
        result[kind]["cpu_vs_plain"] = result[kind]["cpu_ms_per_row"] / plain
    params = {
        "transformer": sum(p.numel() for p in pipe.adapter.transformer.parameters()),
        "controlnet": sum(p.numel() for p in pipe.controlnet.parameters()),
    }
    report = {"settings": vars(ns), "parameters": params, "result": result}
    print(json.dumps(report, indent=2))
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
