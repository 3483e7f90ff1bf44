"""What a step cache is asked to do: `StepCacheSettings`, parsed once from a request's `step_cache` field or the
server's `--step-cache` / `--step-cache-config` flags (no torch here: the routes, the scheduler and the config
layer read it). The policies that act on these settings, per row, live in `step_cache/hooks.py`.

A setting is a method name (`"fbcache"`), an object with the method and its options
(`{"method": "fbcache", "threshold": 0.1}`), or `"off"`. FastVideo's and SGLang's `enable_teacache: true` is
accepted as `{"method": "teacache"}` by the routes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from diffuserve.errors import InvalidRequestError

METHODS = ("fbcache", "magcache", "taylorseer", "teacache")
"""The step-cache methods this server runs (`docs/step-caches.md` says which to pick)."""

DEFAULT_THRESHOLDS = {"fbcache": 0.12, "magcache": 0.06, "teacache": 0.4, "taylorseer": 0.0}
"""Per-method threshold when a setting leaves it out (taylorseer has none: it refreshes on a fixed interval)."""


@dataclass(frozen=True)
class StepCacheSettings:
    """One request's step-cache method and options. Every row of the request decides from its own history."""

    method: str
    """fbcache | magcache | taylorseer | teacache."""
    threshold: float = -1.0
    """fbcache: relative L1 change of the first block's residual below which a row reuses its cached residual;
    teacache: accumulated rescaled change of the modulated input below which a row reuses. -1: the method's
    default (`DEFAULT_THRESHOLDS`)."""
    warmup_steps: int = 2
    """Steps every row computes before it may reuse (its first `warmup_steps` steps)."""
    max_cached_steps: int = 3
    """Consecutive reused steps after which a row computes again, whatever its measure says (0: no limit)."""
    order: int = 1
    """taylorseer: order of the Taylor expansion (0 reuses the last output, 1 extrapolates linearly, ...)."""
    refresh_interval: int = 2
    """taylorseer: a row computes every `refresh_interval` steps and forecasts the ones between."""
    compute_last_step: bool = True
    """Every row computes its final step (the detail a cached last step would blur)."""
    retention_ratio: float = 0.2
    """magcache: share of the first steps every row computes (MagCache's retention ratio)."""
    mag_ratios: tuple[float, ...] = ()
    """magcache: the checkpoint's magnitude ratios per step, from `diffuserve calibrate-cache` (the server fills
    them from `--step-cache-calibration`; not a request option)."""
    calibrate: bool = False
    """Record the magnitude ratios of every computed step instead of reusing any (`diffuserve calibrate-cache`;
    not a request option)."""

    @property
    def resolved_threshold(self) -> float:
        return DEFAULT_THRESHOLDS[self.method] if self.threshold < 0 else self.threshold

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_OPTIONS = {
    f.name: f.type for f in dataclasses.fields(StepCacheSettings) if f.name not in ("method", "mag_ratios", "calibrate")
}
"""The options a request or `--step-cache-config` may set, and their types."""


def _option(field: str, key: str, value: Any) -> Any:
    """One option's value, checked: the error names the field and the key."""
    kind = _OPTIONS[key]
    if kind == "bool":
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{field}.{key} must be true or false, got {value!r}.", param=field)
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{field}.{key} must be a number, got {value!r}.", param=field)
    if kind == "int":
        if int(value) != value:
            raise InvalidRequestError(f"{field}.{key} must be a whole number, got {value!r}.", param=field)
        value = int(value)
    limits = {
        "threshold": (0.0, 10.0),
        "warmup_steps": (0, 1000),
        "max_cached_steps": (0, 1000),
        "order": (0, 4),
        "refresh_interval": (1, 100),
        "retention_ratio": (0.0, 1.0),
    }
    low, high = limits[key]
    if key == "threshold" and value == -1:
        return float(value)
    if not low <= value <= high:
        raise InvalidRequestError(f"{field}.{key}={value} is out of range; it must be in [{low}, {high}].", param=field)
    return float(value) if kind == "float" else value


def parse_step_cache(value: Any, field: str = "step_cache") -> StepCacheSettings | None:
    """A request's (or the server's) step-cache setting -> settings, or None for `"off"` / null.

    Raises InvalidRequestError naming `field` for an unknown method, an unknown option or a value out of range.
    """
    if value is None or value is False or value == "off":
        return None
    if isinstance(value, StepCacheSettings):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                return parse_step_cache(json.loads(text), field)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{field} is not valid JSON: {exc}.", param=field) from exc
        value = {"method": text}
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"{field} must be a method name, an object with a 'method', or \"off\"; got {value!r}.", param=field
        )
    method = value.get("method")
    if method in (None, "off"):
        if set(value) - {"method"}:
            raise InvalidRequestError(f"{field} has options but no 'method'; name one of {list(METHODS)}.", param=field)
        return None
    if method not in METHODS:
        raise InvalidRequestError(
            f'{field}: unknown method {method!r}; choose one of {list(METHODS)} or "off".', param=field
        )
    unknown = sorted(set(value) - set(_OPTIONS) - {"method"})
    if unknown:
        raise InvalidRequestError(
            f"{field}: unknown option(s) {unknown}; the options are {sorted(_OPTIONS)}.", param=field
        )
    options = {key: _option(field, key, v) for key, v in value.items() if key != "method"}
    return StepCacheSettings(method=str(method), **options)


def server_step_cache(method: str | None, config: str | None) -> StepCacheSettings | None:
    """The server default from `--step-cache METHOD` and `--step-cache-config JSON` (options of that method)."""
    if not method or method == "off":
        return None
    options: dict[str, Any] = {}
    if config:
        options = json.loads(config)
        if not isinstance(options, dict):
            raise InvalidRequestError(
                "--step-cache-config must be a JSON object of options.", param="--step-cache-config"
            )
    return parse_step_cache({**options, "method": method}, "--step-cache")


@functools.lru_cache(maxsize=8)
def load_calibration(path: str) -> tuple[float, ...]:
    """The magnitude ratios of a `diffuserve calibrate-cache` file; ValueError naming what is wrong."""
    try:
        with open(path) as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the calibration {path!r}: {exc}") from exc
    ratios = data.get("mag_ratios") if isinstance(data, dict) else None
    if not isinstance(ratios, list) or not ratios or not all(isinstance(r, int | float) for r in ratios):
        raise ValueError(f"{path!r} holds no 'mag_ratios' list; write it with `diffuserve calibrate-cache`")
    return tuple(float(r) for r in ratios)


def with_calibration(
    settings: StepCacheSettings | None, path: str | None, field: str = "step_cache"
) -> StepCacheSettings | None:
    """`settings` with the server's magnitude ratios when its method is magcache (a 400 naming `field` when the
    server has none)."""
    if settings is None or settings.method != "magcache" or settings.mag_ratios:
        return settings
    if not path:
        raise InvalidRequestError(
            f"{field}: magcache needs this checkpoint's magnitude ratios; start the server with "
            "--step-cache-calibration FILE (made by `diffuserve calibrate-cache`), or use "
            "fbcache, taylorseer or teacache.",
            param=field,
        )
    return dataclasses.replace(settings, mag_ratios=load_calibration(path))
