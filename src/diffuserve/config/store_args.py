"""StoreArgs: where results and video jobs are kept when several replicas share them (the `Results store` flags).

The embedded default is SQLite + files under --output-dir (HttpArgs, with the retention flags); these
flags replace either half with a store every replica reaches: PostgreSQL for the rows, an S3-compatible
bucket for the media. They may be used together or apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from diffuserve.config.argparse_dataclass import check_flags, flag

STORE_GROUP = "Results store"
MAX_PRESIGN_S = 7 * 24 * 3600
"""S3's longest presigned URL (SigV4): seven days."""


@dataclass
class StoreArgs:
    """The shared metadata database and media store, and the owner lease of live jobs."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve",)

    results_db: str | None = flag(
        None,
        "PostgreSQL URL (postgresql://user:pass@host:port/db) for the rows of video jobs and url images, shared by "
        "every replica; a replica migrates the schema at start-up. Default: SQLite under --output-dir.",
        STORE_GROUP,
    )
    """Metadata store URL; None = SQLite `results.db` under --output-dir."""
    media_store: str | None = flag(
        None,
        "s3://BUCKET/PREFIX: keep the media of results (MP4s, url images) in an S3-compatible bucket; credentials and "
        "region from the standard AWS_* environment variables. Default: files under --output-dir.",
        STORE_GROUP,
    )
    """Media store URL; None = files under --output-dir/media."""
    s3_endpoint_url: str | None = flag(
        None,
        "Endpoint of a non-AWS S3-compatible server (MinIO, SeaweedFS, Ceph: http://host:port), addressed path-style; "
        "also AWS_ENDPOINT_URL.",
        STORE_GROUP,
    )
    """S3 endpoint; None = AWS (or AWS_ENDPOINT_URL)."""
    media_store_create_bucket: bool = flag(
        False,
        "Create the --media-store bucket at start-up when it does not exist (off: a missing bucket fails start-up).",
        STORE_GROUP,
    )
    """Bucket creation switch."""
    media_presign_s: int = flag(
        0,
        "With --media-store: answer GET /v1/videos/{id}/content (variant=video) and url images with a redirect to a "
        "presigned URL valid this many seconds, instead of streaming the bytes through the server. 0 = stream.",
        STORE_GROUP,
    )
    """Presigned redirect lifetime; 0 = proxy the bytes."""
    owner_timeout_s: float = flag(
        120.0,
        "A replica renews its lease every --result-sweep-interval-s; when another replica's lease is older than this "
        "(SIGKILL, host loss), its queued and running jobs fail with code interrupted.",
        STORE_GROUP,
    )
    """Lease expiry of a replica that stopped renewing."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix (reachability is checked when the stores open)."""
        db = urlsplit(self.results_db or "")
        media = urlsplit(self.media_store or "")
        check_flags(
            [
                (
                    self.results_db is not None and (db.scheme not in ("postgresql", "postgres") or not db.netloc),
                    "--results-db",
                    f"{self.results_db!r} is not a PostgreSQL URL; give postgresql://USER:PASSWORD@HOST:PORT/DB",
                ),
                (
                    self.media_store is not None and (media.scheme != "s3" or not media.netloc),
                    "--media-store",
                    f"{self.media_store!r} is not an S3 URL; give s3://BUCKET or s3://BUCKET/PREFIX",
                ),
                (
                    self.s3_endpoint_url is not None and urlsplit(self.s3_endpoint_url).scheme not in ("http", "https"),
                    "--s3-endpoint-url",
                    f"{self.s3_endpoint_url!r} must be an http:// or https:// URL",
                ),
                (
                    self.s3_endpoint_url is not None and self.media_store is None,
                    "--s3-endpoint-url",
                    "only applies with --media-store s3://BUCKET/PREFIX",
                ),
                (
                    self.media_presign_s < 0 or self.media_presign_s > MAX_PRESIGN_S,
                    "--media-presign-s",
                    f"{self.media_presign_s} must be 0 (stream) to {MAX_PRESIGN_S} (seven days)",
                ),
                (
                    self.media_presign_s > 0 and self.media_store is None,
                    "--media-presign-s",
                    "needs --media-store s3://BUCKET/PREFIX (files under --output-dir are streamed)",
                ),
                (self.owner_timeout_s <= 0, "--owner-timeout-s", f"{self.owner_timeout_s} must be > 0"),
            ]
        )
