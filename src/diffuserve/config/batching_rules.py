"""The `--batching-config` file: per-model / per-shape caps below `--batching-max-size`.

Format (JSON, or YAML when the file ends in .yaml/.yml)::

    {"schema_version": 1,
     "rules": [{"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1},
               {"model": "wan-t2v", "resolution": "*", "num_frames": 81, "max_batch_size": 2}]}

A rule matches a request when its model selector matches one of the names the request can be
known by (served name, model id, model path), its resolution is `*` or equals the request's
`WxH`, and its `num_frames` (if given) equals the request's frame count. `model_contains` is a
case-insensitive substring test because checkpoint paths and hub ids differ in case from what
people type; `model` is an exact comparison. When several rules match, the smallest cap wins:
rules only ever lower the cap, so the most cautious one is the safe choice.

Parsing is pydantic (`extra="forbid"`, strict integers); every validation error is turned into a
`ConfigError` that names the file, the rule index and the key, and suggests the closest valid key
for a typo, so a bad file fails at start-up with a message the user can act on.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from diffuserve.errors import ConfigError

SUPPORTED_SCHEMA_VERSIONS = (1,)
_RESOLUTION_RE = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")
_FLAG = "--batching-config"


class BatchingRule(BaseModel):
    """One cap: requests for a matching model/shape never batch beyond `max_batch_size` outputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    """Exact model name (served name, model id or model path) this rule applies to."""
    model_contains: str | None = None
    """Substring (case-insensitive) of any of the model's names this rule applies to."""
    resolution: str = "*"
    """`WxH` (e.g. `1024x1024`) or `*` for every resolution."""
    num_frames: StrictInt | None = Field(default=None, ge=1)
    """Frame count this rule applies to (video); None for any."""
    max_batch_size: StrictInt = Field(ge=1)
    """Largest batch, counting outputs (`n`), for matching requests."""

    @field_validator("resolution")
    @classmethod
    def _check_resolution(cls, value: str) -> str:
        if value != "*" and not _RESOLUTION_RE.match(value):
            raise ValueError("must be 'WxH' with positive integers (e.g. '1024x1024') or '*'")
        return value

    @model_validator(mode="after")
    def _one_model_selector(self) -> BatchingRule:
        if (self.model is None) == (self.model_contains is None):
            got = "both" if self.model is not None else "neither"
            raise ValueError(f"give exactly one of 'model' or 'model_contains' (got {got})")
        for key in ("model", "model_contains"):
            if getattr(self, key) == "":
                raise ValueError(f"'{key}' must not be empty")
        return self

    def matches(self, model_names: Sequence[str], width: int, height: int, num_frames: int) -> bool:
        """Whether this rule applies to a request with these names and shape."""
        if self.model is not None:
            model_ok = self.model in model_names
        else:
            needle = (self.model_contains or "").lower()
            model_ok = any(needle in name.lower() for name in model_names)
        if not model_ok:
            return False
        if self.resolution != "*" and self.resolution != f"{width}x{height}":
            return False
        return self.num_frames is None or self.num_frames == num_frames


class BatchingRules(BaseModel):
    """The parsed `--batching-config` file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: StrictInt
    """Format version of the file; only 1 exists."""
    rules: tuple[BatchingRule, ...]
    """The caps, in file order (order does not matter: the smallest matching cap wins)."""

    @field_validator("schema_version")
    @classmethod
    def _check_version(cls, value: int) -> int:
        if value not in SUPPORTED_SCHEMA_VERSIONS:
            raise ValueError(f"unsupported schema_version {value}; this version of diffuserve reads 1")
        return value

    def cap_for(self, model_names: Sequence[str], width: int, height: int, num_frames: int) -> int | None:
        """The smallest `max_batch_size` among matching rules; None when no rule matches."""
        caps = [r.max_batch_size for r in self.rules if r.matches(model_names, width, height, num_frames)]
        return min(caps) if caps else None


def load_batching_rules(path: str | Path) -> BatchingRules:
    """Read and validate a `--batching-config` file; raise `ConfigError` naming file, rule and key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{_FLAG}: cannot read {str(path)!r}: {exc}. Pass a readable JSON or YAML file.") from exc
    data = _parse(path, text)
    return parse_batching_rules(data, source=str(path))


def parse_batching_rules(data: Any, *, source: str = "<inline>") -> BatchingRules:
    """Validate already-parsed rules data (a dict); `source` names the file in error messages."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_FLAG} {source}: the top level must be an object with 'schema_version' and 'rules', "
            f"got {type(data).__name__}."
        )
    try:
        return BatchingRules.model_validate(data)
    except ValidationError as exc:
        problems = _describe_all(exc.errors(include_url=False))
        raise ConfigError(f"{_FLAG} {source}: " + "; ".join(problems)) from exc


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml  # only needed for YAML files

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{_FLAG} {path}: invalid YAML: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{_FLAG} {path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}. "
            "(Use a .yaml/.yml suffix for YAML.)"
        ) from exc


_TOP_KEYS = tuple(BatchingRules.model_fields)
_RULE_KEYS = tuple(BatchingRule.model_fields)


def _where(loc: tuple[Any, ...]) -> tuple[str, tuple[str, ...], str | None]:
    """(human location, valid keys at that level, key) for a pydantic error location."""
    if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
        key = str(loc[2]) if len(loc) > 2 else None
        return f"rules[{loc[1]}]", _RULE_KEYS, key
    key = str(loc[0]) if loc else None
    return "top level", _TOP_KEYS, key


def _closest(key: str | None, valid: Sequence[str]) -> list[str]:
    return difflib.get_close_matches(key or "", valid, n=1, cutoff=0.5)


def _describe_all(errors: Sequence[Any]) -> list[str]:
    """Describe each error, dropping 'missing X' where a typo of X in the same place explains it."""
    typo_fixes: set[tuple[str, str]] = set()
    for err in errors:
        where, valid, key = _where(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            typo_fixes.update((where, close) for close in _closest(key, valid))
    out = []
    for err in errors:
        where, _valid, key = _where(tuple(err["loc"]))
        if err["type"] == "missing" and (where, key) in typo_fixes:
            continue
        out.append(_describe(err))
    return out


def _describe(err: Any) -> str:
    """One validation error as a sentence naming the rule index and key, with a fix."""
    where, valid, key = _where(tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        close = _closest(key, valid)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{where}: unknown key '{key}'; {hint}valid keys are {', '.join(valid)}"
    if kind == "missing":
        return f"{where}: missing required key '{key}'"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"{where}: must be an object (mapping of keys to values), got {err.get('input')!r}"
    if kind in ("tuple_type", "list_type"):
        return f"{where} key '{key}': must be a list of rules, got {err.get('input')!r}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if key is None:
        return f"{where}: {msg}"
    return f"{where} key '{key}': {msg} (got {err.get('input')!r})"
