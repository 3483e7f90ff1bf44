"""Helpers the family tests share: pixel comparison, residency set-up, rebuilds, the continuous group loop.

The generic checks themselves (diffusers parity, merged rows, residency modes, limits ...) are the family
conformance suite, test_family_conformance.py. Use from a family test module:

    from tests.integration.family_checks import max_pixel_diff, with_residency
    output, ledger = with_residency(pipeline, {"vae": ResidencyMode.COMPONENT_OFFLOAD}, run)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diffuserve.config.model_profiles import group_of
from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.pipelines.base import AllResident
from diffuserve.runtime.layerwise import default_layer_specs
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.runtime.residency import build_residency


def _frames(output: Any) -> list[np.ndarray]:
    """Images, or videos (lists of frames), as one flat list of int16 arrays."""
    flat: list[np.ndarray] = []
    for item in output:
        for frame in item if isinstance(item, list) else [item]:
            flat.append(np.asarray(frame).astype(np.int16))
    return flat


def max_pixel_diff(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Largest per-pixel difference (of 255) between two lists of images or videos of the same shapes."""
    fa, fb = _frames(a), _frames(b)
    assert len(fa) == len(fb), (len(fa), len(fb))
    return max(int(np.abs(x - y).max()) for x, y in zip(fa, fb, strict=True))


def layered_components(pipeline: Any) -> list[str]:
    """The pipeline's components whose class declares repeated layers (what layer-wise offload streams)."""
    return [name for name, module in pipeline.components.items() if default_layer_specs(name, module)]


def with_residency(
    pipeline: Any, modes: dict[str, ResidencyMode], run: Callable[[], Any], ledger: TransferLedger | None = None
) -> tuple[Any, TransferLedger]:
    """`run()` with the given components under the given modes (the rest resident); the residency is removed
    afterwards. Returns run's output and the ledger of the moves (`ledger`, or a new one)."""
    plan = DeploymentPlan(components={n: ComponentPlan(name=n, group=group_of(n), mode=m) for n, m in modes.items()})
    ledger = ledger if ledger is not None else TransferLedger()
    pipeline.residency = build_residency(plan, pipeline.components, device="cpu", ledger=ledger)
    try:
        return run(), ledger
    finally:
        close = getattr(pipeline.residency, "close", None)
        if close is not None:
            close()
        pipeline.residency = AllResident()


def row_generators(seed: int, n: int) -> list:
    """A diffusers reference call's generators: one CPU generator per output row, row j seeded seed + j."""
    import torch

    return [torch.Generator().manual_seed(seed + j) for j in range(n)]


def assert_rebuild_identical(build: str, built: Path, work: Path, *, max_bytes: int = 10 * 2**20) -> None:
    """A second `make-tiny` build of `build` writes the same files with the same bytes, in under `max_bytes`."""
    from diffuserve.models.tiny import build_tiny_checkpoint

    again = build_tiny_checkpoint(build, work / build)
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    different = [str(f) for f in files if (built / f).read_bytes() != (again / f).read_bytes()]
    assert not different, different
    assert sum((built / f).stat().st_size for f in files) < max_bytes


def simulate_steps(pipeline: Any, arrivals: dict[int, list], whole: dict[int, Any] | None = None) -> dict[int, list]:
    """Run the continuous group loop as the engine does: the requests in `arrivals[k]` start together (shared
    encoder calls) and join before global step k; those that finish at one step are decoded together. Returns
    each request's images (or videos) by its index in arrival order; `whole`, when given, gets each request's
    whole `RequestOutput` (its audio too) by the same index."""
    from diffuserve.pipelines import step_batch

    group: list[tuple[int, Any]] = []
    out: dict[int, list] = {}
    order = [p for k in sorted(arrivals) for p in arrivals[k]]
    tick = 0
    while len(out) < len(order):
        joining = arrivals.get(tick, [])
        if joining:
            started = step_batch.start_requests(pipeline, joining)
            group += [(order.index(params), rows) for params, rows in zip(joining, started, strict=True)]
        step_batch.denoise_step(pipeline, [rows for _, rows in group])
        done = [g for g in group if g[1].done]
        if done:
            outputs = step_batch.finish_requests(pipeline, [rows for _, rows in done])
            for (index, rows), output in zip(done, outputs, strict=True):
                out[index] = output.videos if pipeline.output_kind == "video" else output.images
                if whole is not None:
                    whole[index] = output
                group.remove((index, rows))
        tick += 1
    return out
