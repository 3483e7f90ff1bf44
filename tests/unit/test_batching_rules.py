"""`--batching-config` loading, validation messages and rule matching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffuserve.config.batching_rules import BatchingRule, BatchingRules, load_batching_rules
from diffuserve.errors import ConfigError

NAMES = ("qwen-image", "Qwen/Qwen-Image", "/ckpt/Qwen-Image")


def write(tmp_path: Path, data: object, name: str = "rules.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else str(data), encoding="utf-8")
    return path


def load_error(tmp_path: Path, data: object) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_batching_rules(path)
    message = str(info.value)
    assert str(path) in message and "--batching-config" in message
    return message


def test_loads_the_seed_example(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "schema_version": 1,
            "rules": [{"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1}],
        },
    )
    rules = load_batching_rules(path)
    assert rules.cap_for(NAMES, 1024, 1024, 1) == 1
    assert rules.cap_for(NAMES, 512, 512, 1) is None
    assert rules.cap_for(("flux",), 1024, 1024, 1) is None


def test_loads_yaml(tmp_path: Path) -> None:
    text = "schema_version: 1\nrules:\n  - model: qwen-image\n    max_batch_size: 3\n"
    for suffix in ("yaml", "yml"):
        rules = load_batching_rules(write(tmp_path, text, f"rules.{suffix}"))
        assert rules.cap_for(NAMES, 64, 64, 1) == 3


def test_smallest_matching_cap_wins_and_selectors_match() -> None:
    rules = BatchingRules(
        schema_version=1,
        rules=(
            BatchingRule(model_contains="QWEN", max_batch_size=6),  # case-insensitive substring
            BatchingRule(model="Qwen/Qwen-Image", resolution="512x256", max_batch_size=2),
            BatchingRule(model="Qwen-Image", max_batch_size=1),  # exact: matches no name
            BatchingRule(model_contains="wan", num_frames=81, max_batch_size=1),
        ),
    )
    assert rules.cap_for(NAMES, 64, 64, 1) == 6
    assert rules.cap_for(NAMES, 512, 256, 1) == 2
    assert rules.cap_for(NAMES, 256, 512, 1) == 6  # WxH order matters
    assert rules.cap_for(("Wan2.1-T2V",), 64, 64, 81) == 1
    assert rules.cap_for(("Wan2.1-T2V",), 64, 64, 33) is None


def test_empty_rules_match_nothing() -> None:
    assert BatchingRules(schema_version=1, rules=()).cap_for(NAMES, 64, 64, 1) is None


def test_typo_names_rule_index_key_and_suggestion(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        {
            "schema_version": 1,
            "rules": [{"model": "a", "max_batch_size": 2}, {"model_contains": "a", "max_batch_sise": 2}],
        },
    )
    assert "rules[1]" in message and "'max_batch_sise'" in message
    assert "did you mean 'max_batch_size'" in message
    assert "rules[0]" not in message


def test_top_level_typo_is_suggested(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"schema_version": 1, "rule": []})
    assert "unknown key 'rule'" in message and "did you mean 'rules'" in message


def test_missing_max_batch_size(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"schema_version": 1, "rules": [{"model_contains": "x"}]})
    assert "rules[0]" in message and "missing required key 'max_batch_size'" in message


@pytest.mark.parametrize("value", [0, -2, "4", 2.5, True])
def test_bad_max_batch_size(tmp_path: Path, value: object) -> None:
    message = load_error(tmp_path, {"schema_version": 1, "rules": [{"model": "x", "max_batch_size": value}]})
    assert "rules[0] key 'max_batch_size'" in message


@pytest.mark.parametrize("value", ["1024", "1024x", "0x64", "64*64", "ax b", "64X64"])
def test_bad_resolution(tmp_path: Path, value: str) -> None:
    message = load_error(
        tmp_path, {"schema_version": 1, "rules": [{"model": "x", "resolution": value, "max_batch_size": 1}]}
    )
    assert "rules[0] key 'resolution'" in message and "WxH" in message and repr(value) in message


@pytest.mark.parametrize(("rule", "got"), [({"model": "a", "model_contains": "b"}, "both"), ({}, "neither")])
def test_exactly_one_model_selector(tmp_path: Path, rule: dict, got: str) -> None:
    message = load_error(tmp_path, {"schema_version": 1, "rules": [{**rule, "max_batch_size": 1}]})
    assert "rules[0]" in message and "'model'" in message and "'model_contains'" in message and got in message


@pytest.mark.parametrize("version", [2, 0, "1"])
def test_unsupported_schema_version(tmp_path: Path, version: object) -> None:
    message = load_error(tmp_path, {"schema_version": version, "rules": []})
    assert "schema_version" in message


def test_missing_schema_version(tmp_path: Path) -> None:
    assert "missing required key 'schema_version'" in load_error(tmp_path, {"rules": []})


def test_wrong_shapes(tmp_path: Path) -> None:
    assert "top level must be an object" in load_error(tmp_path, [1, 2])
    assert "must be a list of rules" in load_error(tmp_path, {"schema_version": 1, "rules": "x"})
    assert "rules[0]: must be an object" in load_error(tmp_path, {"schema_version": 1, "rules": [5]})


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_batching_rules(missing)
    assert str(missing) in str(info.value)

    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"schema_version": 1,\n "rules": [}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"invalid JSON at line 2") as info:
        load_batching_rules(bad_json)
    assert str(bad_json) in str(info.value)

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("rules: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_batching_rules(bad_yaml)
