"""BatchingConfig and BatchingMode: the `--batching-*` flags, owned once and read by the schedulers.

`ServerArgs.batching` is the instance the CLI fills; the engine's schedulers (engine/scheduler.py,
engine/step_scheduler.py) take it as their config, with `rules` loaded from `--batching-config`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag
from diffuserve.config.batching_rules import BatchingRules, load_batching_rules
from diffuserve.errors import ConfigError

BATCHING_GROUP = "Batching"


class BatchingMode(str, enum.Enum):
    """How requests share pipeline calls. A `str` enum: `mode == "dynamic"` and JSON keep working."""

    SINGLETON = "singleton"
    """One request per pipeline call."""
    DYNAMIC = "dynamic"
    """Merge compatible queued requests into one call (request-level batching)."""
    CONTINUOUS = "continuous"
    """Step-level: requests join and leave the running denoise group at step boundaries
    (engine/step_scheduler.py); its request-level fallback merges like `dynamic`."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


_MODES = tuple(m.value for m in BatchingMode)
ORDERS = ("fifo", "drr")
"""`--batching-order` choices: `fifo` (the head of the queue anchors the next batch) or `drr` (deficit round-robin
over the waiting batch classes, by tokens x steps; engine/scheduler.py rule 10)."""
_GENERATE_MODES = (BatchingMode.SINGLETON.value, BatchingMode.DYNAMIC.value)
"""`generate`'s choices: its prompts all arrive at once (through the serving engine, `engine/offline.py`), so
continuous mode's joins at step boundaries would add nothing to dynamic batching there."""


@dataclass
class BatchingConfig:
    """How the scheduler forms batches (the `--batching-*` flags)."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve",)

    mode: BatchingMode = flag(
        BatchingMode.SINGLETON,
        "singleton (one request per pipeline call), dynamic (merge compatible queued requests) or continuous "
        "(requests join and leave the running denoise group at step boundaries).",
        BATCHING_GROUP,
        dest="batching_mode",
        choices=_MODES,
        commands=("serve", "generate", "plan"),
        per_command={
            "generate": {
                "choices": _GENERATE_MODES,
                "help": "With several --prompt flags: dynamic runs them in batches of --batching-max-size outputs.",
            },
            "plan": {
                "group": None,
                "help": "The batching mode `serve` would use: the plan refuses "
                "continuous for a model that cannot step in a shared group, as start-up does.",
            },
        },
    )
    """`singleton` (one request per pipeline call), `dynamic` (merge compatible requests) or `continuous`
    (step-level: requests join and leave the running denoise group at step boundaries)."""
    max_size: int = flag(
        1,
        "Dynamic mode: most rows (outputs, n) in one pipeline call. Compatible requests merge under it; a request "
        "with a larger n runs as several calls (same images). 1 turns merging off.",
        BATCHING_GROUP,
        dest="batching_max_size",
        commands=("serve", "generate"),
    )
    """User cap on a batch, counting outputs (`n`), and a hard cap on the rows of every pipeline call in
    dynamic mode; 1 turns merging off."""
    max_tokens: int | None = flag(
        None,
        "Most latent tokens (tokens per row x rows) in one batch or continuous group; --batching-max-size still caps "
        "the rows. Unset: for a model that packs mixed sizes, --batching-max-size x the tokens of the largest size it "
        "allows, capped by the activation-memory budget; none for others (docs/batching.md). A request larger than "
        "it alone runs alone.",
        BATCHING_GROUP,
        dest="batching_max_tokens",
    )
    """Token budget of one batch (dynamic) or denoise group (continuous): the sum over its rows of the latent tokens
    of each row's size; None: derived at start-up (`config/token_budget.py`)."""
    order: str = flag(
        "fifo",
        "Which waiting batch class runs next: fifo (the oldest request's) or drr (deficit round-robin by tokens x "
        "steps, so a large size neither starves nor blocks the small ones). Dynamic batches, and continuous mode's "
        "joins at step boundaries (each size takes its turn).",
        BATCHING_GROUP,
        dest="batching_order",
        choices=ORDERS,
    )
    """`fifo` (the head of the queue anchors the next batch; continuous joins in queue order) or `drr` (deficit
    round-robin over the batch classes; continuous: over the waiting classes by size, for each join)."""
    delay_ms: float = flag(
        0.0,
        "How long the head of the queue may wait for compatible requests.",
        BATCHING_GROUP,
        dest="batching_delay_ms",
    )
    """How long the head of the queue may wait for compatible requests, in milliseconds."""
    rules: BatchingRules | None = field(default=None, metadata={"cli": False})
    """Lower caps per model/resolution/frames from `--batching-config`; None for no rules."""
    max_adapters: int | None = field(default=None, metadata={"cli": False})
    """Most distinct LoRA adapters one batch (dynamic) or denoise group (continuous) may use: `--max-loras`, the
    device slots, filled in by launch when LoRA is on (not a flag of its own); None: any."""
    rules_path: str | None = flag(
        None, "JSON/YAML rules giving lower caps per model/resolution.", BATCHING_GROUP, dest="batching_config"
    )
    """Path of the rules file (`with_rules()` loads it into `rules`)."""
    enable_metrics: bool = flag(
        False,
        "Log one line per dispatch and a stats line every 5 dispatches.",
        BATCHING_GROUP,
        dest="enable_batching_metrics",
    )
    """Batching log lines (Prometheus metrics are always on)."""

    def __post_init__(self) -> None:
        if isinstance(self.mode, str) and self.mode in _MODES:  # an unknown mode is left for validate()
            self.mode = BatchingMode(self.mode)

    def validate(self) -> None:
        """Raise `ConfigError` naming the flag when a value is out of range (no I/O: see `check_files`)."""
        if self.mode not in _MODES:
            raise ConfigError(f"--batching-mode: unknown mode {self.mode!r}; use one of {', '.join(_MODES)}.")
        max_size_ok = isinstance(self.max_size, int) and not isinstance(self.max_size, bool) and self.max_size >= 1
        tokens = self.max_tokens
        tokens_ok = tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1)
        check_flags(
            [
                (not max_size_ok, "--batching-max-size", f"{self.max_size!r} must be >= 1 (1 turns merging off)"),
                (not self.delay_ms >= 0, "--batching-delay-ms", f"{self.delay_ms!r} must be >= 0"),  # also rejects NaN
                (not tokens_ok, "--batching-max-tokens", f"{self.max_tokens!r} must be >= 1 (unset: derived)"),
                (self.order not in ORDERS, "--batching-order", f"{self.order!r} is not one of {', '.join(ORDERS)}"),
            ]
        )

    def check_files(self) -> None:
        """The checks that read the file system (after every value check)."""
        if self.rules_path is not None and not Path(self.rules_path).is_file():
            raise ConfigError(f"--batching-config: cannot read {self.rules_path!r} (no such file).")

    def with_rules(self) -> BatchingConfig:
        """A copy with `rules` read from `--batching-config` (unchanged without one)."""
        if not self.rules_path:
            return replace(self)
        return replace(self, rules=load_batching_rules(self.rules_path))

    def never_merges(self) -> str | None:
        """The start-up warning of a mode that merges requests with a cap that never lets it (`--batching-max-size`
        1, its default); None otherwise."""
        if self.mode not in (BatchingMode.DYNAMIC, BatchingMode.CONTINUOUS) or self.max_size > 1:
            return None
        return (
            f"--batching-mode {self.mode} with --batching-max-size {self.max_size}: no two requests will ever be "
            "merged (each batch runs one request); set --batching-max-size N (e.g. 4) to merge up to N rows."
        )

    @property
    def dynamic(self) -> bool:
        """Whether requests may be merged at all."""
        return self.mode in (BatchingMode.DYNAMIC, BatchingMode.CONTINUOUS) and self.max_size > 1
