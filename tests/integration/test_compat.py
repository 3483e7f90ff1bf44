"""The compatibility grid of docs/families.md agrees with a fresh run of the grid's cheap part (`compat --quick`)."""

from __future__ import annotations

from pathlib import Path

from diffuserve.tools.compat import COLUMNS, QUICK_COLUMNS, image_builds, parse_grid, render, run_compat

README = Path(__file__).resolve().parents[2] / "docs" / "families.md"
"""The page holding the grid (it was the README's until the docs split)."""
CHECKED = ("flux", "sd3")
"""Builds re-run here (the whole grid takes minutes; `diffuserve compat` regenerates it)."""


def _readme_grid() -> dict[str, dict[str, str]]:
    text = README.read_text()
    begin, end = text.index("<!-- compat-grid:begin -->"), text.index("<!-- compat-grid:end -->")
    return parse_grid(text[begin:end])


def test_readme_grid_lists_every_image_build() -> None:
    grid = _readme_grid()
    assert sorted(grid) == sorted(image_builds()), "regenerate the grid in docs/families.md with `diffuserve compat`"
    for build, cells in grid.items():
        assert set(cells.values()) <= {"✅", "❌", "-"}, (build, cells)


def test_readme_grid_agrees_with_a_fresh_quick_run() -> None:
    rows = run_compat(CHECKED, quick=True, log=lambda _line: None)
    fresh = parse_grid(render(rows))
    readme = _readme_grid()
    for build in CHECKED:
        assert {c: fresh[build][c] for c in QUICK_COLUMNS} == {c: readme[build][c] for c in QUICK_COLUMNS}, (
            build,
            rows[CHECKED.index(build)].notes,
        )
    assert set(fresh[CHECKED[0]]) == set(COLUMNS)
