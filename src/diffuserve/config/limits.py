"""LimitsArgs: request size caps and security switches (the `Admission, limits and security` flags).

The engine's admission limits of the same `--help` group (`--max-queue-size`, `--request-timeout-s`)
are owned by `EngineConfig` (config/engine_limits.py), which the engine reads directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag

LIMITS_GROUP = "Admission, limits and security"


@dataclass
class LimitsArgs:
    """Body and prompt size caps, the API key, prompt truncation and remote fetches."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve",)

    max_request_bytes: int = flag(
        4 * 1024 * 1024, "Largest request body; bigger ones get HTTP 413 before being read whole.", LIMITS_GROUP
    )
    """Body size cap."""
    max_upload_bytes: int = flag(
        16 * 1024 * 1024,
        "Largest multipart body of POST /v1/images/edits (image upload included); bigger ones get HTTP 413.",
        LIMITS_GROUP,
    )
    """Upload cap for edits."""
    max_prompt_chars: int = flag(10000, "Longest prompt / negative prompt in characters.", LIMITS_GROUP)
    """String length cap."""
    api_key: str | None = flag(
        None,
        "Require `Authorization: Bearer KEY` on every endpoint except /liveness, /health, /metrics (also "
        "DIFFUSERVE_API_KEY).",
        LIMITS_GROUP,
    )
    """API key; never logged."""
    reject_truncated_prompts: bool = flag(
        False,
        "Answer 400 (param prompt) when a prompt is longer than a text encoder takes, instead of running it cut off "
        "with a warning in the response.",
        LIMITS_GROUP,
    )
    """Strict prompt-length mode (the default warns: response `warnings` and one log line per request)."""
    allow_remote_urls: bool = flag(
        False,
        "Allow request fields that make the server fetch remote URLs (off: such fields are rejected).",
        LIMITS_GROUP,
    )
    """Remote fetch switch."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        check_flags(
            [
                (
                    self.max_request_bytes < 1024,
                    "--max-request-bytes",
                    f"{self.max_request_bytes} is too small (>= 1024)",
                ),
                (self.max_upload_bytes < 1024, "--max-upload-bytes", f"{self.max_upload_bytes} is too small (>= 1024)"),
                (self.max_prompt_chars < 1, "--max-prompt-chars", f"{self.max_prompt_chars} must be >= 1"),
            ]
        )
