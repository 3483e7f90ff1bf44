"""Results that survive a restart: SQLite (WAL) metadata and media files under --output-dir."""

from diffuserve.storage.results import LIVE_STATUSES, Record, ResultStore, RetentionPolicy

__all__ = ["LIVE_STATUSES", "Record", "ResultStore", "RetentionPolicy"]
