"""The PostgreSQL metadata store (`--results-db postgresql://...`): one database shared by every replica.

psycopg 3 with a connection pool; every statement of the results store runs here as written for SQLite
(`?` placeholders become `%s`). What PostgreSQL adds for a fleet:

* a versioned schema, migrated at start-up under an advisory lock (replicas starting together migrate once);
* a fleet-wide advisory lock around the retention sweep, so retention runs on one replica at a time;
* `NOTIFY diffuserve_results, '<id>'` when a result finishes or is deleted, delivered on commit to a
  `LISTEN`ing thread of every replica: the owner of a job cancelled or deleted through another replica
  stops it at its next denoising step instead of at its next sweep.

A database that stops answering while serving raises `StoreUnavailableError` (503 naming
--results-db); the pool reconnects by itself once it is back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from diffuserve.errors import ConfigError
from diffuserve.storage.media import StoreUnavailableError
from diffuserve.storage.metadata import SCHEMA_VERSION, newer_schema_error

logger = logging.getLogger("diffuserve.storage")

MIGRATE_LOCK = 0x64696666_7573_01
"""pg_advisory_lock key held while one replica migrates the schema."""
SWEEP_LOCK = 0x64696666_7573_02
"""pg_advisory_lock key of the retention sweep (one replica of the fleet sweeps at a time)."""
CHANNEL = "diffuserve_results"
"""LISTEN/NOTIFY channel: the payload is the id of a result that finished or was deleted."""

MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE IF NOT EXISTS results (
    seq          BIGSERIAL PRIMARY KEY,
    id           TEXT NOT NULL UNIQUE,
    kind         TEXT NOT NULL,
    status       TEXT NOT NULL,
    owner        TEXT NOT NULL,
    created_at   DOUBLE PRECISION NOT NULL,
    completed_at DOUBLE PRECISION,
    expires_at   DOUBLE PRECISION,
    bytes        BIGINT NOT NULL DEFAULT 0,
    files        TEXT NOT NULL DEFAULT '[]',
    meta         TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS results_kind_seq ON results (kind, seq);
CREATE INDEX IF NOT EXISTS results_status ON results (status);
CREATE TABLE IF NOT EXISTS owners (
    owner        TEXT PRIMARY KEY,
    heartbeat_at DOUBLE PRECISION NOT NULL
);
""",
}
"""Version -> the statements that bring the schema from the previous version to it."""


def redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def location(url: str) -> dict[str, Any]:
    """Host, port and database of a PostgreSQL URL or `key=value` DSN: what logs and /server_info show (never the
    user or password)."""
    if "://" in url:
        parts = urlsplit(url)
        return {"host": parts.hostname, "port": parts.port or 5432, "database": parts.path.lstrip("/") or None}
    pairs = dict(item.split("=", 1) for item in url.split() if "=" in item)
    return {"host": pairs.get("host"), "port": int(pairs.get("port", 5432)), "database": pairs.get("dbname")}


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class _Tx:
    """A transaction of the SQLite-dialect statements on a psycopg connection."""

    def __init__(self, conn: Any):
        self.conn = conn

    def execute(self, sql: str, args: tuple = ()) -> Any:
        return self.conn.execute(_pg(sql), args)


class PostgresMetadata:
    """Results and owners in a PostgreSQL database (give diffuserve a database of its own)."""

    def __init__(self, url: str, *, pool_size: int = 8, timeout_s: float = 10.0):
        import psycopg
        from psycopg_pool import ConnectionPool

        self._psycopg = psycopg
        self.url = url
        self.name = f"--results-db {redact(url)}"
        self.where: dict[str, Any] = {"kind": "postgresql", **location(url)}
        self.timeout_s = timeout_s
        self._migrate()
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            timeout=timeout_s,
            open=True,
            kwargs={"autocommit": True, "connect_timeout": max(1, int(timeout_s))},
            check=ConnectionPool.check_connection,
            name="diffuserve-results",
        )
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.listening = threading.Event()
        """Set while the LISTEN connection is up (notifications from then on are delivered)."""

    def _connect(self) -> Any:
        return self._psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, int(self.timeout_s)))

    def _migrate(self) -> None:
        """Bring the schema to SCHEMA_VERSION under an advisory lock; fail naming --results-db when the
        database cannot be reached or its schema is newer."""
        try:
            conn = self._connect()
        except self._psycopg.Error as exc:
            raise ConfigError(
                f"{self.name}: cannot connect ({str(exc).strip()}); check the host, port, user, "
                "password and database name, and that the server accepts connections."
            ) from None
        with conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK,))
            try:
                conn.execute("CREATE TABLE IF NOT EXISTS diffuserve_schema (version INTEGER NOT NULL)")
                row = conn.execute("SELECT max(version) FROM diffuserve_schema").fetchone()
                found = row[0] or 0
                if found > SCHEMA_VERSION:
                    raise newer_schema_error(self.name, found)
                for version in range(found + 1, SCHEMA_VERSION + 1):
                    with conn.transaction():
                        conn.execute(MIGRATIONS[version])
                        conn.execute("INSERT INTO diffuserve_schema (version) VALUES (%s)", (version,))
                    logger.info("%s: schema migrated to version %d", self.name, version)
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK,))

    def _unavailable(self, exc: Exception) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"The results database ({self.name}) is unavailable: {str(exc).strip()}. Retry once it is back.",
            retry_after_s=2.0,
        )

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        from psycopg_pool import PoolTimeout

        try:
            with self._pool.connection() as conn:
                yield conn
        except (self._psycopg.OperationalError, PoolTimeout) as exc:
            raise self._unavailable(exc) from exc

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Tx]:
        with self._connection() as conn, conn.transaction():
            yield _Tx(conn)

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._connection() as conn:
            return conn.execute(_pg(sql), args).fetchall()

    @contextlib.contextmanager
    def fleet_lock(self) -> Iterator[bool]:
        # A session lock on one pooled connection, held for the whole sweep (whose statements use others).
        with self._connection() as conn:
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (SWEEP_LOCK,)).fetchone()[0]
            try:
                yield bool(got)
            finally:
                if got:
                    conn.execute("SELECT pg_advisory_unlock(%s)", (SWEEP_LOCK,))

    def notify(self, tx: _Tx, rid: str) -> None:
        tx.conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, rid))

    def watch(self, callback: Callable[[str], None]) -> None:
        if self._watcher is not None:
            return
        self._watch_stop.clear()
        self._watcher = threading.Thread(
            target=self._listen, args=(callback,), name="diffuserve-results-listen", daemon=True
        )
        self._watcher.start()

    def _listen(self, callback: Callable[[str], None]) -> None:
        """LISTEN on a dedicated connection; reconnect (every 2 s) when it drops."""
        while not self._watch_stop.is_set():
            try:
                with self._connect() as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    while not self._watch_stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            try:
                                callback(note.payload)
                            except Exception:  # noqa: BLE001 - one bad callback must not stop the listener
                                logger.exception("results notification %s: callback failed", note.payload)
            except self._psycopg.Error as exc:
                self.listening.clear()
                logger.warning("%s: LISTEN connection lost (%s); reconnecting", self.name, str(exc).strip())
                self._watch_stop.wait(2.0)

    def close(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        self._pool.close()
