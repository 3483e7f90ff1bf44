"""LimitsArgs: request size caps and security switches (the `Admission, limits and security` flags).

The engine's admission limits of the same `--help` group (`--max-queue-size`, `--request-timeout-s`)
are owned by `EngineConfig` (config/engine.py), which the engine reads directly.
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
    allowed_media_domains: list[str] = flag(
        [],
        "With --allow-remote-urls: the only hosts an image URL (and every redirect it takes) may name, matched "
        "exactly (case-insensitive; `cdn.example.com` does not admit `img.cdn.example.com`). Default: any public "
        "host. Loopback, private, link-local, multicast and reserved addresses are refused either way.",
        LIMITS_GROUP,
        metavar="HOST",
    )
    """Exact-host allow list of remote image fetches (empty: any host whose addresses are public)."""
    media_fetch_timeout_s: float = flag(
        10.0,
        "With --allow-remote-urls: seconds one image URL may take in all (name lookup, connect, every redirect and "
        "the whole body); past it the request is a 400 naming the field.",
        LIMITS_GROUP,
    )
    """Total deadline of one remote image fetch (a slow-drip answer is cut off by it, not only by idle time)."""

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
                (
                    self.media_fetch_timeout_s <= 0,
                    "--media-fetch-timeout-s",
                    f"{self.media_fetch_timeout_s} must be > 0",
                ),
                (
                    bool(self.allowed_media_domains) and not self.allow_remote_urls,
                    "--allowed-media-domains",
                    "has no effect without --allow-remote-urls (no URL is fetched); add --allow-remote-urls or drop it",
                ),
                *[
                    (
                        not _is_host(entry),
                        "--allowed-media-domains",
                        f"{entry!r} is not a host name or IP address (give hosts only: `cdn.example.com`, without a "
                        "scheme, port, path or wildcard)",
                    )
                    for entry in self.allowed_media_domains
                ],
            ]
        )


def _is_host(entry: str) -> bool:
    """A bare host name or IP literal (what a URL's host is compared with), not a URL or a pattern."""
    return bool(entry) and not any(c in entry for c in "/:*@?# ") or _is_ipv6(entry)


def _is_ipv6(entry: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(entry.strip("[]")).version == 6
    except ValueError:
        return False
