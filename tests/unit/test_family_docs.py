"""docs/families.md's facts tables are what the family specs generate (so the page cannot drift from them)."""

from __future__ import annotations

import dataclasses

import pytest

from diffuserve.family_spec import FamilySpec, ProfileFacts, all_specs
from diffuserve.tools import family_docs


def test_docs_families_tables_match_the_specs() -> None:
    text = family_docs.DOC.read_text()
    generated = family_docs.replace_section(text, family_docs.render())
    assert generated == text, f"docs/families.md differs from the family specs; run `{family_docs.REGENERATE}`"
    assert family_docs.main(["--check"]) == 0


def test_every_family_has_a_row_in_both_tables() -> None:
    lines = family_docs.render().splitlines()
    for name in all_specs():
        assert sum(line.startswith(f"| `{name}` |") for line in lines) == 2, name


def test_a_changed_spec_is_caught() -> None:
    specs = list(all_specs().values())
    changed = [dataclasses.replace(specs[0], max_image_inputs=specs[0].max_image_inputs + 1)] + specs[1:]
    assert family_docs.render(changed) != family_docs.render(specs)


def test_optional_columns_appear_only_for_existing_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    existing = {f.name for f in dataclasses.fields(FamilySpec)} | {f.name for f in dataclasses.fields(ProfileFacts)}
    headers = [c.header for c in family_docs.serving_columns()]
    for field_name, column in family_docs.OPTIONAL_COLUMNS:
        assert (column.header in headers) == (field_name in existing)
    extra = family_docs.Column("Output", lambda s: s.output_kind)
    monkeypatch.setattr(family_docs, "OPTIONAL_COLUMNS", (("output_kind", extra),))
    assert family_docs.serving_columns()[-1] is extra


def test_replace_section_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="family-facts:begin"):
        family_docs.replace_section("no markers here", "x")
    filled = family_docs.replace_section(f"a\n{family_docs.BEGIN}\nold\n{family_docs.END}\nb", "new\n")
    assert filled == f"a\n{family_docs.BEGIN}\nnew\n{family_docs.END}\nb"
