"""`diffuserve compat`: the compatibility grid, generated from real runs on each family's tiny checkpoint.

For every `make-tiny` build of an image family, the checkpoint is built offline and run through the serving
path (`launch/root.build_engine`: the loader, the deployment plan, residency, the scheduler and the engine loop —
everything `serve` runs except HTTP):

- **T2I**: one text-to-image request returns its `n` images at the asked size;
- **I2I**: one edit (an input image) returns `n` images (edit families, FLUX img2img, FLUX.2 references);
- **Batching**: two compatible requests with prompts of different lengths merge into one pipeline call
  (`batch_size` 2 in both answers) and each merged row equals its singleton run within 1/255 per pixel;
- **Residency**: component-offload, snapshot-offload and layer-wise offload (of every component that
  declares layers) each reproduce the resident output within 1/255;
- **Matches diffusers**: the native backend's image equals the unmodified diffusers pipeline's
  (`--backend diffusers`, same request) within 1/255.

A cell is ✅ (ran and matched), ❌ (ran and failed, with the reason in the notes) or - (not applicable: the
family has no such task, or no native adapter to compare). The README's grid is this command's output.
"""

from __future__ import annotations

import asyncio
import io
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, FAIL, NA = "✅", "❌", "-"
MAX_PIXEL_DIFF = 1
"""Largest per-pixel difference (of 255) that still counts as equal."""
SIZE = 64
"""Request size in pixels (every tiny checkpoint runs at 64x64)."""
STEPS = 2
"""Denoising steps per request."""
RESIDENCY_MODES = ("component-offload", "snapshot-offload", "layerwise-offload")
COLUMNS = ("T2I", "I2I", "Batching", "Residency", "Matches diffusers")
QUICK_COLUMNS = ("T2I", "I2I", "Batching")
"""The cheap part (`--quick`): what the README test re-runs; the other columns stay as the full run found."""


@dataclass
class CompatRow:
    """One line of the grid: a tiny build of a family and its cells."""

    build: str
    """`make-tiny --family` name."""
    family: str
    """Family spec name."""
    pipeline_class: str
    """The diffusers pipeline class of the checkpoint."""
    cells: dict[str, str] = field(default_factory=lambda: dict.fromkeys(COLUMNS, NA))
    """Column -> ✅ / ❌ / -."""
    notes: list[str] = field(default_factory=list)
    """Why a cell failed, and measured differences."""


def _max_diff(a: Any, b: Any) -> int:
    import numpy as np

    return int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())


def _same(a: Sequence[Any], b: Sequence[Any]) -> tuple[bool, int]:
    if len(a) != len(b) or any(x.size != y.size for x, y in zip(a, b, strict=True)):
        return False, 255
    worst = max((_max_diff(x, y) for x, y in zip(a, b, strict=True)), default=0)
    return worst <= MAX_PIXEL_DIFF, worst


class _Engine:
    """An in-process serving engine over a checkpoint, started and stopped around a block."""

    def __init__(self, model_path: Path, **overrides: Any) -> None:
        from diffuserve.config.deployment import DeploymentArgs
        from diffuserve.config.server_args import ServerArgs

        residency = overrides.pop("component_residency", [])
        self.args = ServerArgs(
            model_path=str(model_path),
            device="cpu",
            enable_warmup=False,
            num_threads=1,
            served_model_name="compat",
            **overrides,
        )
        self.args.deployment = DeploymentArgs(component_residency=list(residency))

    def __enter__(self) -> _Engine:
        from diffuserve.launch.root import build_engine

        self.engine, _, _ = build_engine(self.args)
        self.engine.start()
        if not self.engine.wait_ready(timeout=600) or self.engine.model is None:
            raise RuntimeError(self.engine.failure or "the engine did not become ready")
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.stop()

    def run(self, requests: list[dict[str, Any]], *, edit: bool = False) -> list[Any]:
        """Submit every request at once; returns each GenerationResult in order."""
        from diffuserve.sampling import build_sampling_params

        model = self.engine.model
        params = [build_sampling_params(model, **r) for r in requests]

        async def go() -> list[Any]:
            return await asyncio.gather(
                *(self.engine.generate(p, ineligible_reason="image_conditioning" if edit else None) for p in params)
            )

        return asyncio.run(go())


def _request(prompt: str, seed: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "seed": seed, "width": SIZE, "height": SIZE, "num_inference_steps": STEPS, **extra}


def _input_image() -> bytes:
    """A deterministic 64x64 gradient PNG as the edit input."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, SIZE, dtype=np.uint8)
    pixels = np.stack(
        [np.tile(ramp, (SIZE, 1)), np.tile(ramp[:, None], (1, SIZE)), np.full((SIZE, SIZE), 96, np.uint8)], -1
    )
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _check(row: CompatRow, column: str, test: Callable[[], tuple[bool, str]]) -> None:
    try:
        ok, note = test()
    except Exception as exc:  # noqa: BLE001 - a failing family is a ❌ with its reason, not a crashed grid
        ok, note = False, f"{type(exc).__name__}: {exc}"[:300]
    row.cells[column] = OK if ok else FAIL
    if note:
        row.notes.append(f"{column}: {note}")


def _layered_components(model_path: Path) -> list[str]:
    from diffuserve.config.model_profiles import profile_from_checkpoint

    profile = profile_from_checkpoint(model_path)
    return [name for name, comp in profile.components.items() if comp.has_layers]


def check_build(build: str, work_dir: Path, *, quick: bool = False) -> CompatRow:
    """Build one tiny checkpoint and fill its grid row (`quick`: the QUICK_COLUMNS only)."""
    from diffuserve import family_spec
    from diffuserve.models.registry import read_model_index
    from diffuserve.models.tiny import build_tiny_checkpoint

    spec = family_spec.spec_for(family_spec.family_of_tiny(build))
    path = build_tiny_checkpoint(build, work_dir / build)
    if spec.output_kind == "mesh":
        return _check_mesh_build(build, spec, path, quick=quick)
    row = CompatRow(build=build, family=spec.name, pipeline_class=read_model_index(path)["_class_name"])
    if spec.output_kind != "image":
        row.notes.append("video family: see the video grid")
        return row
    t2i = "t2i" in spec.tasks
    i2i = "i2i" in spec.tasks and spec.max_image_inputs > 0
    image = _input_image()
    first = _request("a red circle on a white background", 1)
    second = _request("a small blue square in the top left corner of a wide green field", 2)
    edit = _request("make it blue", 3, image_inputs=(image,), n=2)
    probe = first if t2i else edit
    is_edit = not t2i

    with _Engine(path) as singleton:
        reference = [r.output.images for r in singleton.run([first])] if t2i else None
        solo = [r.output.images for r in singleton.run([second])] if t2i else None
        if t2i:
            _check(row, "T2I", lambda: (len(reference[0]) == 1 and reference[0][0].size == (SIZE, SIZE), ""))
        if i2i:
            edited = singleton.run([edit], edit=True)[0].output.images
            # Families whose pipeline sizes its output from the input (Qwen-Image-Layered) are checked on `n` only.
            sized = spec.output_size_follows_input or all(im.size == (SIZE, SIZE) for im in edited)
            _check(
                row, "I2I", lambda: (len(edited) == 2 and sized, "" if sized else f"sizes {[im.size for im in edited]}")
            )
        base = reference[0] if t2i else edited

    if t2i and spec.supports_batching:

        def merged() -> tuple[bool, str]:
            with _Engine(path, batching_mode="dynamic", batching_max_size=2, batching_delay_ms=60_000) as dynamic:
                results = dynamic.run([first, second])
            sizes = [r.batch_size for r in results]
            ok_a, diff_a = _same(results[0].output.images, reference[0])
            ok_b, diff_b = _same(results[1].output.images, solo[0])
            return sizes == [2, 2] and ok_a and ok_b, f"batch sizes {sizes}, max diff {max(diff_a, diff_b)}/255"

        _check(row, "Batching", merged)

    if spec.has_native and not quick:
        layered = _layered_components(path)

        def residency() -> tuple[bool, str]:
            worst, failures = 0, []
            for mode in RESIDENCY_MODES:
                targets = layered if mode == "layerwise-offload" else ["all"]
                with _Engine(path, component_residency=[f"{t}={mode}" for t in targets]) as offloaded:
                    out = offloaded.run([probe], edit=is_edit)[0].output.images
                ok, diff = _same(out, base)
                worst = max(worst, diff)
                if not ok:
                    failures.append(f"{mode} differs by {diff}/255")
            return not failures, "; ".join(failures) or f"max diff {worst}/255 (layer-wise on {', '.join(layered)})"

        _check(row, "Residency", residency)

        def diffusers() -> tuple[bool, str]:
            with _Engine(path, backend="diffusers") as reference_backend:
                out = reference_backend.run([probe], edit=is_edit)[0].output.images
            ok, diff = _same(out, base)
            return ok, f"max diff {diff}/255"

        if spec.name in MASK_ONLY_REFERENCES:
            row.notes.append(f"Matches diffusers: {MASK_ONLY_REFERENCES[spec.name]}")
        else:
            _check(row, "Matches diffusers", diffusers)
    return row


MASK_ONLY_REFERENCES = {
    "flux_fill": "FluxFillPipeline takes no edit without a mask (the grid's probe has none), so the backend cannot "
    "run it; with masks the native edits equal it (tests/integration/test_masks.py)",
}
"""Families whose diffusers pipeline refuses the grid's mask-less probe edit -> where they are compared instead."""


MESH_TOLERANCE = 1e-4
"""Largest vertex coordinate difference (in the [-1.01, 1.01] box) that still counts as equal for meshes."""


def _same_meshes(a: Sequence[Any], b: Sequence[Any]) -> tuple[bool, float]:
    import numpy as np

    if len(a) != len(b) or any(x.vertices.shape != y.vertices.shape for x, y in zip(a, b, strict=True)):
        return False, float("inf")
    worst = max((float(np.abs(x.vertices - y.vertices).max(initial=0)) for x, y in zip(a, b, strict=True)), default=0)
    return worst <= MESH_TOLERANCE, worst


def _check_mesh_build(build: str, spec: Any, path: Path, *, quick: bool) -> CompatRow:
    """Image-to-3D families (Hunyuan3D-2): I2I is one image -> one mesh; Batching, two jobs merged, each row's
    vertices equal to its solo run; Residency, whole-component offloads reproduce the resident mesh. Nothing to
    compare with diffusers (no diffusers pipeline): equality with the reference package is its own test."""
    from diffuserve.models.registry import resolve_model

    row = CompatRow(build=build, family=spec.name, pipeline_class=resolve_model(path).pipeline_class)
    first = {"prompt": "", "seed": 1, "num_inference_steps": STEPS, "image_inputs": (_input_image(),)}
    second = {**first, "seed": 2}
    with _Engine(path) as singleton:
        reference = singleton.run([first])[0].output.meshes
        solo = singleton.run([second])[0].output.meshes
    _check(
        row,
        "I2I",
        lambda: (
            len(reference) == 1 and reference[0].error is None,
            reference[0].error or f"{len(reference[0].faces)} faces",
        ),
    )

    def merged() -> tuple[bool, str]:
        with _Engine(path, batching_mode="dynamic", batching_max_size=2, batching_delay_ms=60_000) as dynamic:
            results = dynamic.run([first, second])
        sizes = [r.batch_size for r in results]
        ok_a, diff_a = _same_meshes(results[0].output.meshes, reference)
        ok_b, diff_b = _same_meshes(results[1].output.meshes, solo)
        return sizes == [2, 2] and ok_a and ok_b, f"batch sizes {sizes}, max vertex diff {max(diff_a, diff_b):.1e}"

    _check(row, "Batching", merged)
    if not quick:

        def residency() -> tuple[bool, str]:
            worst, failures = 0.0, []
            for mode in RESIDENCY_MODES[:2]:  # no layer table for Tencent's layout: whole components only
                with _Engine(path, component_residency=[f"all={mode}"]) as offloaded:
                    ok, diff = _same_meshes(offloaded.run([first])[0].output.meshes, reference)
                worst = max(worst, diff)
                if not ok:
                    failures.append(f"{mode} differs by {diff:.1e}")
            return not failures, "; ".join(failures) or f"max vertex diff {worst:.1e} (component and snapshot offload)"

        _check(row, "Residency", residency)
    row.notes.append(
        "Matches diffusers: no diffusers pipeline; equals hy3dgen 2.0.2 (tests/integration/test_hunyuan3d_reference.py)"
    )
    return row


def image_builds() -> list[str]:
    """Every `make-tiny` name of an image (or image-to-mesh) family, in the order the family modules list them."""
    from diffuserve import family_spec

    return [
        name
        for spec in family_spec.all_specs().values()
        if spec.output_kind in ("image", "mesh")
        for name in spec.tiny_builds
    ]


def render(rows: Sequence[CompatRow]) -> str:
    """The grid as a Markdown table (the README's shape), then the notes."""
    lines = [
        "| Model (make-tiny) | Pipeline class | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append(f"| {row.build} | `{row.pipeline_class}` | " + " | ".join(row.cells[c] for c in COLUMNS) + " |")
    lines.append("")
    lines.append(
        f"{OK} ran and matched, {FAIL} ran and failed, - not applicable. "
        f"{SIZE}x{SIZE}, {STEPS} steps, equal = within {MAX_PIXEL_DIFF}/255 per pixel."
    )
    notes = [f"- {row.build}: {note}" for row in rows for note in row.notes]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def parse_grid(text: str) -> dict[str, dict[str, str]]:
    """build -> column -> cell, from a rendered grid (or the README section holding it)."""
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 2 + len(COLUMNS) and parts[0] not in ("Model (make-tiny)", "---"):
            rows[parts[0]] = dict(zip(COLUMNS, parts[2:], strict=True))
    return rows


def run_compat(
    builds: Sequence[str] | None = None,
    output: Path | None = None,
    *,
    quick: bool = False,
    log: Callable[[str], None] = print,
) -> list[CompatRow]:
    """Fill the grid for `builds` (default: every image family's tiny builds); write Markdown to `output`."""
    import logging

    logging.getLogger("diffuserve").setLevel(logging.WARNING)
    names = list(builds or image_builds())
    known = set(image_builds())
    unknown = [n for n in names if n not in known]
    if unknown:
        from diffuserve.errors import ConfigError

        raise ConfigError(
            f"--families: {unknown} are not tiny builds of image families; choose from {sorted(known)}.",
            param="families",
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="diffuserve-compat-") as tmp:
        for name in names:
            started = time.monotonic()
            row = check_build(name, Path(tmp), quick=quick)
            rows.append(row)
            log(
                f"{name}: "
                + ", ".join(f"{c} {row.cells[c]}" for c in COLUMNS)
                + f" ({time.monotonic() - started:.1f}s)"
            )
    text = render(rows)
    if output is not None:
        Path(output).write_text(text)
    return rows
