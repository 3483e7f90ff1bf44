"""StepCacheArgs: the server's default step cache (`--step-cache`, `--step-cache-config`,
`--step-cache-calibration`), taken by `serve` and `generate`. What a setting means is `config/step_cache.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag
from diffuserve.config.http_args import SERVER_GROUP
from diffuserve.config.step_cache import METHODS, load_calibration, server_step_cache, with_calibration
from diffuserve.errors import ConfigError, InvalidRequestError


@dataclass
class StepCacheArgs:
    """The step cache every request runs unless it sets its own `step_cache` (docs/step-caches.md)."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate")

    method: str | None = flag(
        None,
        f"Default step cache of requests that set no `step_cache`: one of {list(METHODS)} "
        "or off (docs/step-caches.md).",
        SERVER_GROUP,
        dest="step_cache",
        per_command={
            "generate": {"help": f"Step cache of every row: one of {list(METHODS)} or off (docs/step-caches.md)."}
        },
    )
    """The step-cache method every request runs unless it sets its own `step_cache` (None / "off": none)."""
    options: str | None = flag(
        None,
        'Options of --step-cache as JSON, e.g. \'{"threshold": 0.1, "warmup_steps": 2, "max_cached_steps": 3}\'.',
        SERVER_GROUP,
        dest="step_cache_config",
    )
    """JSON object of the default method's options (threshold, warmup_steps, max_cached_steps, order,
    refresh_interval, compute_last_step)."""
    calibration: str | None = flag(
        None,
        "JSON file of the checkpoint's magnitude ratios for --step-cache magcache (`diffuserve calibrate-cache`).",
        SERVER_GROUP,
        dest="step_cache_calibration",
    )
    """The `diffuserve calibrate-cache` output that magcache requests use."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        check_flags(
            [
                (
                    bool(self.options) and not self.method,
                    "--step-cache-config",
                    "gives options but --step-cache names no method; add e.g. --step-cache fbcache",
                ),
            ]
        )
        try:
            default = server_step_cache(self.method, self.options)
        except (InvalidRequestError, ValueError) as exc:
            raise ConfigError(f"--step-cache / --step-cache-config: {exc}") from exc
        try:
            if self.calibration:
                load_calibration(self.calibration)
            with_calibration(default, self.calibration, "--step-cache")
        except (InvalidRequestError, ValueError) as exc:
            raise ConfigError(f"--step-cache-calibration: {exc}") from exc
