"""EngineConfig: how the engine admits, times and warms up requests (`--max-queue-size`,
`--request-timeout-s`, `--enable-warmup`, `--warmup-steps`), owned once and read by engine/engine.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag
from diffuserve.config.http_args import SERVER_GROUP
from diffuserve.config.limits import LIMITS_GROUP


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
    warmup_resolutions: list[tuple[int, int]] = field(default_factory=list, metadata={"cli": False})
    """(width, height) pairs warmed up besides the default size (compile / graph capture per shape); from the
    deployment plan's `--warmup-resolutions`."""
    activation_budget_bytes: int | None = field(default=None, metadata={"cli": False})
    """The resolved activation budget of one replica (the deployment plan's `activation_memory_bytes`); None:
    unbounded."""

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
            ]
        )
