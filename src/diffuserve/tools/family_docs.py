"""The family facts tables of `docs/families.md`, generated from the family specs (`diffuserve.family_spec`).

The tables sit between two markers in that page; everything else there is hand-written prose. Regenerate them
after changing a spec:

    python -m diffuserve.tools.family_docs --write        # rewrite the tables in docs/families.md
    python -m diffuserve.tools.family_docs --check        # exit 1 when the page and the specs disagree

`tests/unit/test_family_docs.py` runs the check, so the page cannot drift from the specs. To show a new spec
fact, add one `Column` to `SERVING_COLUMNS` or `PLAN_COLUMNS` (or an `OPTIONAL_COLUMNS` entry for a field that
may not exist yet), then regenerate. Only the specs are read: no torch, no weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuserve.family_spec import FamilySpec, ProfileFacts, all_specs

BEGIN = "<!-- family-facts:begin -->"
END = "<!-- family-facts:end -->"
REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "families.md"
"""The page holding the tables (a source checkout; pass --doc for another path)."""
REGENERATE = "python -m diffuserve.tools.family_docs --write"


@dataclass(frozen=True)
class Column:
    """One column of a facts table."""

    header: str
    """Column title in the Markdown table."""
    cell: Callable[[FamilySpec], str]
    """The cell text for one family, from its spec alone."""


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _code(items: Iterable[str]) -> str:
    return ", ".join(f"`{item}`" for item in items) or "–"


def _fact(spec: FamilySpec, name: str) -> Any:
    """A fact from the spec itself or, failing that, its plan profile (so a field may move between the two)."""
    return getattr(spec, name) if hasattr(spec, name) else getattr(spec.profile, name)


PIPELINE_DEFAULT = "pipeline's"
"""Cell text where the diffusers backend takes the value from the pipeline's `__call__` (not from the spec)."""
TASK_ORDER = ("t2i", "i2i", "t2v", "i2v")


def _tasks(spec: FamilySpec) -> str:
    return ", ".join(sorted(spec.tasks, key=lambda t: (TASK_ORDER.index(t) if t in TASK_ORDER else len(TASK_ORDER), t)))


def _steps(spec: FamilySpec) -> str:
    return str(spec.defaults.num_inference_steps) if spec.has_native else PIPELINE_DEFAULT


def _size(spec: FamilySpec) -> str:
    # The diffusers backend reads size, frames, steps and guidance from the pipeline's call signature
    # (pipelines/diffusers_backend.py `_defaults`); only true CFG and the negative prompt come from the spec.
    if not spec.has_native:
        return PIPELINE_DEFAULT
    d = spec.defaults
    size = f"{d.width}x{d.height}"
    return f"{size}, {d.num_frames} frames, {d.fps} fps" if spec.output_kind == "video" else size


def _guidance(spec: FamilySpec) -> str:
    d = spec.defaults
    parts = [f"guidance {d.guidance_scale:g}" if spec.has_native else f"guidance {PIPELINE_DEFAULT}"]
    if d.guidance_scale_2 is not None:
        parts.append(f"low-noise expert {d.guidance_scale_2:g}")
    if d.true_cfg_scale != 1.0:
        parts.append(f"true CFG {d.true_cfg_scale:g}")
    if d.negative_prompt is not None:
        parts.append(f'negative `"{d.negative_prompt}"`')
    return ", ".join(parts)


def _cfg_parallel(spec: FamilySpec) -> str:
    # The start-up rules (parallel/cfg_parallel.py): a native adapter is needed, and a doubled-batch CFG refuses it.
    if not spec.has_native:
        return "no (diffusers backend)"
    return "no (doubled batch)" if _fact(spec, "cfg_batched") else "yes"


def _gib(value: float | None) -> str:
    return "never" if value is None else f"{value:g}"


def _size_multiple(spec: FamilySpec) -> str:
    """A fixed multiple, or the rule the spec applies to the checkpoint's configs (VAE factor x patch)."""
    if spec.size_multiple:
        return str(spec.size_multiple)
    return "VAE factor x patch" if spec.latent_geometry is not None else "–"


SERVING_COLUMNS: tuple[Column, ...] = (
    Column("Family", lambda s: f"`{s.name}`"),
    Column("Pipeline classes", lambda s: _code(s.pipeline_classes)),
    Column("Backend", lambda s: "native" if s.has_native else "diffusers"),
    Column("Tasks", _tasks),
    Column("Default size", _size),
    Column("Steps", _steps),
    Column("Guidance defaults", _guidance),
    Column("Size multiple", lambda s: _size_multiple(s)),
    Column("Positional limit", lambda s: "from config" if s.max_latent_side else "none"),
    Column("Input images", lambda s: str(s.max_image_inputs) if s.max_image_inputs else "–"),
    Column("Merges requests", lambda s: _yes(s.supports_batching)),
    Column("make-tiny", lambda s: _code(s.tiny_builds)),
)
"""What a request meets: classes, backend, defaults, size rules, batching, tiny checkpoints."""

PLAN_COLUMNS: tuple[Column, ...] = (
    Column("Family", lambda s: f"`{s.name}`"),
    Column("CFG by default", lambda s: _yes(_fact(s, "default_uses_cfg"))),
    Column("CFG parallel", _cfg_parallel),
    Column("Sequence parallel", lambda s: _yes(_fact(s, "sequence_parallel") and s.has_native)),
    Column("Tensor parallel", lambda s: _yes(_fact(s, "tensor_parallel") and s.has_native)),
    Column("Layer-wise DiT in presets", lambda s: _yes(_fact(s, "dit_supports_layerwise"))),
    Column("FSDP instead of offload", lambda s: _yes(_fact(s, "fsdp_can_replace_dit_offload"))),
    Column("Compile validated", lambda s: _yes(_fact(s, "compile_validated"))),
    Column("DiT resident from (GiB)", lambda s: _gib(_fact(s, "dit_resident_threshold_gib"))),
    Column("VAE resident from (GiB)", lambda s: _gib(_fact(s, "vae_resident_threshold_gib"))),
    Column("Plan defaults of", lambda s: f"`{s.base_family}`" if s.base_family else "–"),
)
"""What `diffuserve plan` and start-up read (`ProfileFacts`)."""

OPTIONAL_COLUMNS: tuple[tuple[str, Column], ...] = (
    ("supports_continuous", Column("Continuous", lambda s: _yes(bool(_fact(s, "supports_continuous"))))),
    ("packs_mixed_sizes", Column("Packs sizes", lambda s: _yes(bool(_fact(s, "packs_mixed_sizes"))))),
)
"""(spec field, column): added to the serving table once `FamilySpec` or `ProfileFacts` has the field."""


def _spec_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(FamilySpec)} | {f.name for f in dataclasses.fields(ProfileFacts)}


def serving_columns() -> tuple[Column, ...]:
    """SERVING_COLUMNS plus the optional columns whose field exists in this release's specs."""
    known = _spec_fields()
    return SERVING_COLUMNS + tuple(column for name, column in OPTIONAL_COLUMNS if name in known)


def render_table(specs: Sequence[FamilySpec], columns: Sequence[Column]) -> str:
    """One Markdown table: a row per spec, a column per `Column`."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.cell(spec) for c in columns) + " |" for spec in specs]
    return "\n".join(lines) + "\n"


def render(specs: Sequence[FamilySpec] | None = None) -> str:
    """The generated part of docs/families.md (between the markers, markers excluded)."""
    specs = list(all_specs().values()) if specs is None else list(specs)
    return (
        f"<!-- generated by `{REGENERATE}` from src/diffuserve/family_spec/; do not edit by hand -->\n\n"
        "**What each family serves** (defaults are the published checkpoint's; an adapter may refine them "
        "from the loaded checkpoint, see the notes below):\n\n"
        + render_table(specs, serving_columns())
        + "\n**What the deployment plan knows** (`ProfileFacts`; thresholds are free GiB per GPU under "
        "`--performance-mode auto`):\n\n" + render_table(specs, PLAN_COLUMNS)
    )


def replace_section(text: str, generated: str) -> str:
    """`text` with everything between BEGIN and END replaced by `generated`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the page has no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def is_current(path: Path = DOC) -> bool:
    """True when the page's tables equal what the specs generate now."""
    text = path.read_text()
    return replace_section(text, render()) == text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffuserve.tools.family_docs", description=__doc__.split("\n")[0])
    parser.add_argument("--doc", type=Path, default=DOC, help="The page to check or rewrite (default: %(default)s).")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="Rewrite the tables in the page.")
    action.add_argument("--check", action="store_true", help="Exit 1 when the page's tables are out of date.")
    ns = parser.parse_args(argv)
    if ns.write:
        ns.doc.write_text(replace_section(ns.doc.read_text(), render()))
        return 0
    if ns.check:
        if is_current(ns.doc):
            return 0
        print(f"{ns.doc}: the family tables differ from the specs; run `{REGENERATE}`.", file=sys.stderr)
        return 1
    print(render(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
