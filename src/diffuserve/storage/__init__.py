"""Results that survive a restart and are shared by replicas: a metadata store (SQLite under --output-dir, or
PostgreSQL with --results-db) and a media store (files under --output-dir, or S3 with --media-store)."""

from diffuserve.storage.media import StoreUnavailableError
from diffuserve.storage.results import LIVE_STATUSES, Record, ResultStore, RetentionPolicy

__all__ = ["LIVE_STATUSES", "Record", "ResultStore", "RetentionPolicy", "StoreUnavailableError"]
