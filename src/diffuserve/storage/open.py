"""Open the results store the flags name: SQLite and/or files under --output-dir, PostgreSQL and/or S3."""

from __future__ import annotations

from pathlib import Path

from diffuserve.errors import ConfigError
from diffuserve.storage.media import MediaStore
from diffuserve.storage.metadata import MetadataStore
from diffuserve.storage.results import ResultStore, RetentionPolicy

STORES_EXTRA = "pip install 'diffuserve[stores]' (psycopg[binary,pool] and boto3)"


def open_metadata(results_db: str) -> MetadataStore:
    try:
        from diffuserve.storage.postgres import PostgresMetadata

        return PostgresMetadata(results_db)
    except ImportError as exc:
        raise ConfigError(
            f"--results-db: PostgreSQL needs psycopg 3 with its pool ({exc.name} is not installed); {STORES_EXTRA}."
        ) from None


def open_media(media_store: str, endpoint_url: str | None, create_bucket: bool) -> MediaStore:
    try:
        from diffuserve.storage.s3 import S3Media

        return S3Media(media_store, endpoint_url=endpoint_url, create_bucket=create_bucket)
    except ImportError as exc:
        raise ConfigError(f"--media-store: S3 needs boto3 ({exc.name} is not installed); {STORES_EXTRA}.") from None


def open_results(
    output_dir: Path,
    policy: RetentionPolicy,
    *,
    results_db: str | None = None,
    media_store: str | None = None,
    s3_endpoint_url: str | None = None,
    create_bucket: bool = False,
) -> ResultStore:
    """The results store: each half shared (PostgreSQL, S3) when its flag is given, else under `output_dir`.
    Raises ConfigError naming the flag when a store cannot be reached or used."""
    metadata = open_metadata(results_db) if results_db else None
    try:
        media = open_media(media_store, s3_endpoint_url, create_bucket) if media_store else None
    except BaseException:
        if metadata is not None:
            metadata.close()
        raise
    root = None if metadata is not None and media is not None else output_dir
    return ResultStore(root, policy, metadata=metadata, media=media)
