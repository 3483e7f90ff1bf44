"""Checks every native family's test file runs the same way: the diffusers reference call, pixel
differences, and a pipeline run under one residency mode for every component."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.runtime.residency import build_residency
from diffuserve.sampling import SamplingParams

GROUPS = {"transformer": "dit", "text_encoder": "text_encoder", "vae": "vae"}


def max_diff(a: Any, b: Any) -> int:
    """Largest per-channel difference of two images, in uint8 steps."""
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


def generators(params: SamplingParams) -> list[torch.Generator]:
    """The reference's generators: one CPU generator per output row, seeded seed + j (the server's rule)."""
    return [torch.Generator().manual_seed(params.seed + j) for j in range(params.n)]


def run_with_residency(pipe: Any, mode: ResidencyMode, batch: list[SamplingParams]) -> tuple[list, list[tuple]]:
    """Run `batch` with every component of `pipe` in `mode`; returns (images of request 0, layer moves)."""
    plans = {name: ComponentPlan(name=name, group=GROUPS.get(name, "other"), mode=mode) for name in pipe.components}
    ledger = TransferLedger()
    pipe.residency = build_residency(DeploymentPlan(components=plans), pipe.components, device="cpu", ledger=ledger)
    try:
        ledger.begin_window()
        images = pipe.run(batch).outputs[0].images
        moves = [(m.component, m.layer) for m in ledger.window_summary().moves if m.direction == "h2d"]
        # Between requests an offloaded component holds no device weights.
        if mode is not ResidencyMode.RESIDENT:
            assert ledger.device_bytes() == 0
    finally:
        pipe.residency.close()
        from diffuserve.pipelines.base import AllResident

        pipe.residency = AllResident()
    return images, moves


def assert_rebuild_identical(build: str, built: Path, work: Path, *, max_bytes: int = 10 * 2**20) -> None:
    """A second `make-tiny` build of `build` writes the same files with the same bytes, in under `max_bytes`."""
    from diffuserve.models.tiny import build_tiny_checkpoint

    again = build_tiny_checkpoint(build, work / build)
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    different = [str(f) for f in files if (built / f).read_bytes() != (again / f).read_bytes()]
    assert not different, different
    assert sum((built / f).stat().st_size for f in files) < max_bytes
