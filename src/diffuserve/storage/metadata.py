"""Metadata stores: the database that keeps one row per result (SQLite on one host, PostgreSQL for a fleet).

Both run the same SQL (written with `?` placeholders; the PostgreSQL store translates them), so the
results store (storage/results.py) holds every query once and a backend only supplies transactions, a
fleet-wide lock for the retention sweep, change notifications and its versioned schema. The schema has
a version number: a replica migrates an older schema forward at start-up (under a lock, so replicas
starting together migrate once) and refuses one newer than it knows, naming both versions.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from diffuserve.errors import ConfigError

SCHEMA_VERSION = 1
"""The schema this code reads and writes; older ones are migrated forward at start-up."""

SQLITE_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE IF NOT EXISTS results (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT NOT NULL UNIQUE,
    kind         TEXT NOT NULL,
    status       TEXT NOT NULL,
    owner        TEXT NOT NULL,
    created_at   REAL NOT NULL,
    completed_at REAL,
    expires_at   REAL,
    bytes        INTEGER NOT NULL DEFAULT 0,
    files        TEXT NOT NULL DEFAULT '[]',
    meta         TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS results_kind_seq ON results (kind, seq);
CREATE INDEX IF NOT EXISTS results_status ON results (status);
CREATE TABLE IF NOT EXISTS owners (
    owner        TEXT PRIMARY KEY,
    heartbeat_at REAL NOT NULL
);
""",
}
"""Version -> the statements that bring the schema from the previous version to it."""


class Cursor(Protocol):
    rowcount: int

    def fetchall(self) -> list[tuple]: ...


class Transaction(Protocol):
    def execute(self, sql: str, args: tuple = ()) -> Cursor: ...


class MetadataStore(Protocol):
    """One table of results and one of owners' heartbeats, behind transactions."""

    name: str
    """What error messages and logs call this store (`--output-dir /x`, `--results-db postgresql://host/db`)."""
    where: dict[str, Any]
    """Where it keeps the rows, for the start-up log and /server_info: `kind` (sqlite | postgresql) and its path, or
    host, port and database; never a user name or password."""

    def transaction(self) -> contextlib.AbstractContextManager[Transaction]:
        """One write transaction: committed when the block ends, rolled back when it raises."""

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        """The rows of one read."""

    def fleet_lock(self) -> contextlib.AbstractContextManager[bool]:
        """True inside the block when this process holds the lock of the retention sweep (no other
        process sharing the store holds it); False when another one does (then skip the sweep)."""

    def notify(self, tx: Transaction, rid: str) -> None:
        """Within `tx`: tell every process sharing the store that `rid` finished or was deleted."""

    def watch(self, callback: Callable[[str], None]) -> None:
        """Call `callback(rid)` (from a thread) for each `notify` of any process; a no-op where the
        backend has no notifications (the periodic sweep covers it)."""

    def close(self) -> None:
        """Release connections (and stop watching)."""


def newer_schema_error(name: str, found: int) -> ConfigError:
    return ConfigError(
        f"{name}: the results schema is version {found}, newer than version {SCHEMA_VERSION} that this "
        "diffuserve knows; upgrade this replica to the release that wrote it (or point it at another "
        "database)."
    )


class SqliteMetadata:
    """`results.db` (WAL) under --output-dir: process-safe on one host, one connection per process behind a
    lock (SQLite serialises writers; `busy_timeout` waits for the lock instead of failing)."""

    def __init__(self, path: Path, name: str):
        self.name = name
        self.where: dict[str, Any] = {"kind": "sqlite", "path": str(path)}
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._migrate()

    def _migrate(self) -> None:
        with self.transaction() as db:  # BEGIN IMMEDIATE: one process migrates, the others wait
            found = db.execute("PRAGMA user_version").fetchall()[0][0]
            if found == 0 and db.execute("SELECT name FROM sqlite_master WHERE name = 'results'").fetchall():
                found = 1  # a folder written before the schema had a version: it is version 1
            if found > SCHEMA_VERSION:
                raise newer_schema_error(self.name, found)
            for version in range(found + 1, SCHEMA_VERSION + 1):
                for statement in filter(str.strip, SQLITE_MIGRATIONS[version].split(";")):
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE takes the write lock up front: no upgrade deadlocks."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @contextlib.contextmanager
    def fleet_lock(self) -> Iterator[bool]:
        # Every process on the host may sweep: each deletion is one conditional statement, so a second
        # sweeper finds nothing left to do.
        yield True

    def notify(self, tx: Any, rid: str) -> None:
        pass

    def watch(self, callback: Callable[[str], None]) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            self._db.close()
