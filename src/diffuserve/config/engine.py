"""EngineConfig: how the engine admits, times and warms up requests (`--max-queue-size`,
`--request-timeout-s`, `--enable-warmup`, `--warmup-steps`), owned once and read by engine/engine.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag
from diffuserve.config.http_args import SERVER_GROUP
from diffuserve.config.limits import LIMITS_GROUP
from diffuserve.config.step_cache import METHODS, load_calibration, server_step_cache, with_calibration
from diffuserve.errors import ConfigError, InvalidRequestError


@dataclass
class EngineConfig:
    """How the engine admits and times requests."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve",)

    max_queue_size: int = flag(
        256, "Queued requests beyond which new ones get HTTP 429 with Retry-After; 0 = unlimited.", LIMITS_GROUP
    )
    """Queued requests beyond which submissions get QueueFullError (429); 0 = unlimited."""
    request_timeout_s: float = flag(
        600.0,
        "Deadline per request (queued -> 504; running -> cancelled at the next step, 504). 0 = none.",
        LIMITS_GROUP,
    )
    """Default and maximum deadline of a request; 0 = none. A request's own `timeout` may only shorten it."""
    activation_memory_gib: float | None = flag(
        None,
        "Activation memory one replica may use at once, in GiB (requests whose estimate alone is over it get HTTP "
        "400 naming the field; work waits until its estimate fits beside what runs). Default: 0.9 x the device's "
        "free memory after the weights (CPU: 0.75 x the available RAM); 0 = unbounded (docs/operations.md).",
        LIMITS_GROUP,
        commands=("serve", "plan"),
    )
    """Activation budget override in GiB (None: derived from the device and the plan, activation.py; 0: no
    budget). `plan` prints what it resolves to; /server_info shows it."""
    enable_warmup: bool = flag(True, "Run one real generation before /health turns 200.", SERVER_GROUP)
    """Run one real generation before turning ready (readiness waits for it)."""
    warmup_steps: int = flag(2, "Denoising steps of the warm-up generation.", SERVER_GROUP)
    """Steps of the warm-up generation (cheap but real)."""
    step_cache: str | None = flag(
        None,
        f"Default step cache of requests that set no `step_cache`: one of {list(METHODS)} "
        "or off (docs/step-caches.md).",
        SERVER_GROUP,
        commands=("serve", "generate"),
        per_command={
            "generate": {"help": f"Step cache of every row: one of {list(METHODS)} or off (docs/step-caches.md)."}
        },
    )
    """The step-cache method every request runs unless it sets its own `step_cache` (None / "off": none)."""
    step_cache_config: str | None = flag(
        None,
        'Options of --step-cache as JSON, e.g. \'{"threshold": 0.1, "warmup_steps": 2, "max_cached_steps": 3}\'.',
        SERVER_GROUP,
        commands=("serve", "generate"),
    )
    """JSON object of the default method's options (threshold, warmup_steps, max_cached_steps, order,
    refresh_interval, compute_last_step)."""
    step_cache_calibration: str | None = flag(
        None,
        "JSON file of the checkpoint's magnitude ratios for --step-cache magcache (`diffuserve calibrate-cache`).",
        SERVER_GROUP,
        commands=("serve", "generate"),
    )
    """The `diffuserve calibrate-cache` output that magcache requests use."""
    warmup_resolutions: list[tuple[int, int]] = field(default_factory=list, metadata={"cli": False})
    activation_budget_bytes: int | None = field(default=None, metadata={"cli": False})
    """The resolved activation budget of one replica (the deployment plan's `activation_memory_bytes`); None:
    unbounded."""
    """(width, height) pairs warmed up besides the default size (compile / graph capture per shape); from the
    deployment plan's `--warmup-resolutions`."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        check_flags(
            [
                (self.max_queue_size < 0, "--max-queue-size", f"{self.max_queue_size} must be >= 0 (0 = unlimited)"),
                (
                    self.request_timeout_s < 0,
                    "--request-timeout-s",
                    f"{self.request_timeout_s} must be >= 0 (0 = none)",
                ),
                (
                    self.activation_memory_gib is not None and self.activation_memory_gib < 0,
                    "--activation-memory-gib",
                    f"{self.activation_memory_gib} must be >= 0 (0 = unbounded)",
                ),
                (self.warmup_steps < 1, "--warmup-steps", f"{self.warmup_steps} must be >= 1"),
                (
                    bool(self.step_cache_config) and not self.step_cache,
                    "--step-cache-config",
                    "gives options but --step-cache names no method; add e.g. --step-cache fbcache",
                ),
            ]
        )
        try:
            default = server_step_cache(self.step_cache, self.step_cache_config)
        except (InvalidRequestError, ValueError) as exc:
            raise ConfigError(f"--step-cache / --step-cache-config: {exc}") from exc
        try:
            if self.step_cache_calibration:
                load_calibration(self.step_cache_calibration)
            with_calibration(default, self.step_cache_calibration, "--step-cache")
        except (InvalidRequestError, ValueError) as exc:
            raise ConfigError(f"--step-cache-calibration: {exc}") from exc
