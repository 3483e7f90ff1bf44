"""The results store: a metadata store (one row per result) and a media store (the files of results).

Two backends of each, behind one interface (storage/metadata.py, storage/media.py), usable together or apart:

    metadata   SQLite (WAL) `results.db` under --output-dir      PostgreSQL (--results-db postgresql://...)
    media      files under --output-dir/media/<id>/<name>        S3-compatible objects (--media-store s3://b/p)

The embedded default (SQLite + files under `--output-dir`) serves one host, and several processes on it::

    results.db (+ -wal, -shm)   one row per result: id, kind (video | image), status, owner, times, meta
    media/<id>/<name>           the files of a result (the MP4, the images of a url response)
    tmp/                        files being written; renamed into media/ only when complete

PostgreSQL + S3 serve a fleet of replicas on many hosts: any replica answers any job.

Why it is safe with several processes: the database serialises writers, every state change is one
conditional UPDATE (a finished result never changes again, whoever tries), and a result's media are
written completely *before* the row that names them is committed, so a reader never finds a row whose
media is missing or half-written. A crash between the upload and the commit leaves an orphan that the
sweep removes once it is older than ORPHAN_GRACE_S.

Retention (`sweep`): rows past `expires_at` go, then the oldest finished results while the media bytes
exceed `max_bytes`; deleting a result removes its media. Live (queued / in_progress) results of a dead
owner are failed with code `interrupted`. On PostgreSQL the retention part runs on one replica at a time
(an advisory lock); every replica beats its heartbeat and fails dead owners' jobs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuserve.storage.media import FileMedia, MediaStore, StoreUnavailableError, safe_name
from diffuserve.storage.metadata import MetadataStore, SqliteMetadata, Transaction
from diffuserve.storage.owners import Owner

logger = logging.getLogger("diffuserve.storage")

LIVE_STATUSES = ("queued", "in_progress")
"""Statuses of a result whose process is still working on it."""

ORPHAN_GRACE_S = 600.0
"""Media without a row are removed only after this long (a writer may be between its upload and its commit)."""
ORPHAN_SCAN_INTERVAL_S = 60.0
"""The sweep looks for orphaned media at most this often."""


@dataclass(frozen=True)
class RetentionPolicy:
    """How long results are kept and how much disk they may take."""

    ttl_s: float = 86400.0
    """Seconds a finished result is kept after it finished (its `expires_at`); 0 = forever."""
    max_bytes: int = 0
    """Media bytes kept in all; past it the oldest finished results are removed first. 0 = no cap."""
    heartbeat_stale_s: float = 120.0
    """An owner whose heartbeat (its lease, renewed at every sweep) is older than this is taken as dead and
    its live results fail `interrupted` (--owner-timeout-s)."""


@dataclass
class Record:
    """One row: a video job or the images of one url response."""

    id: str
    kind: str
    status: str
    owner: str
    created_at: float
    completed_at: float | None = None
    expires_at: float | None = None
    bytes: int = 0
    files: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.status in LIVE_STATUSES


_COLUMNS = "id, kind, status, owner, created_at, completed_at, expires_at, bytes, files, meta"
_UNEXPIRED = "(expires_at IS NULL OR expires_at > ?)"


def _record(row: tuple) -> Record:
    rid, kind, status, owner, created, completed, expires, size, files, meta = row
    return Record(rid, kind, status, owner, created, completed, expires, size, json.loads(files), json.loads(meta))


class ResultStore:
    """Thread-safe; process-safe (and, on PostgreSQL + S3, host-safe) through its stores.

    `ResultStore(root)` is the embedded default (SQLite + files under `root`); `metadata` and `media`
    replace either half (storage/open.py builds them from the flags).
    """

    def __init__(
        self,
        root: Path | str | None,
        policy: RetentionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.time,
        metadata: MetadataStore | None = None,
        media: MediaStore | None = None,
    ):
        self.root = Path(root).expanduser() if root is not None else None
        self.policy = policy or RetentionPolicy()
        self.clock = clock
        self.owner = str(Owner.current())
        if (metadata is None or media is None) and self.root is None:
            raise ValueError("a results store without a root folder needs both a metadata and a media store")
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        self.media_backend: MediaStore = media if media is not None else FileMedia(self.root)  # type: ignore[arg-type]
        self.metadata: MetadataStore = (
            metadata
            if metadata is not None
            else SqliteMetadata(self.root / "results.db", f"--output-dir {str(self.root)!r}")
        )  # type: ignore[operator]
        files = self.media_backend if isinstance(self.media_backend, FileMedia) else None
        self.media: Path | None = files.media if files else None
        """media/ of the file store (None for an object store)."""
        self.tmp: Path | None = files.tmp if files else None
        """tmp/ of the file store (None for an object store)."""
        self.where = {"metadata": self.metadata.where, "media": self.media_backend.where}
        """Where results live (each half's `where`): /server_info shows it, `describe` says it in one line."""
        self.heartbeat()
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._watchers: list[Callable[[str], None]] = []
        """`watch` callbacks (video and mesh jobs each register one); the metadata store calls `_notify`."""
        self._sweep_hooks: list[Callable[[], None]] = []
        """`add_sweep_hook` callbacks, run after each background sweep."""
        self._orphans_checked_at = float("-inf")

    # -- plumbing ----------------------------------------------------------------------------------

    def describe(self) -> str:
        """`where` in one line (the start-up log): "metadata in PostgreSQL db:5432/diffuserve; files in S3 ..."."""

        def half(where: dict[str, Any]) -> str:
            kind = where.get("kind")
            if kind == "postgresql":
                return f"PostgreSQL {where['host']}:{where['port']}/{where['database']}"
            if kind == "s3":
                prefix = f", prefix {where['prefix']}" if where.get("prefix") else ""
                return f"S3 bucket {where['bucket']}{prefix} at {where['endpoint']}"
            return f"{'SQLite' if kind == 'sqlite' else 'folder'} {where.get('path')}"

        return f"metadata in {half(self.where['metadata'])}; files in {half(self.where['media'])}"

    @property
    def names(self) -> str:
        """The stores as the flags name them (for messages)."""
        return f"{self.metadata.name} and {self.media_backend.name}"

    def _tx(self) -> contextlib.AbstractContextManager[Transaction]:
        return self.metadata.transaction()

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self.metadata.query(sql, args)

    def close(self) -> None:
        self.stop_sweeper()
        self.metadata.close()
        self.media_backend.close()

    def expiry(self, finished_at: float) -> float | None:
        return finished_at + self.policy.ttl_s if self.policy.ttl_s > 0 else None

    def watch(self, callback: Callable[[str], None]) -> None:
        """Call `callback(id)` when any process finishes or deletes a result (where the metadata store can
        tell: PostgreSQL's LISTEN/NOTIFY; elsewhere the periodic sweep finds it). Several callbacks may watch."""
        self._watchers.append(callback)
        if len(self._watchers) == 1:
            self.metadata.watch(self._notify)

    def _notify(self, rid: str) -> None:
        for callback in list(self._watchers):
            try:
                callback(rid)
            except Exception:  # noqa: BLE001 - one bad callback must not keep the others from hearing it
                logger.exception("results notification %s: callback failed", rid)

    def add_sweep_hook(self, callback: Callable[[], None]) -> None:
        """Run `callback` after each background sweep too (beside `start_sweeper`'s `after_sweep`)."""
        self._sweep_hooks.append(callback)

    # -- writing -----------------------------------------------------------------------------------

    def add(self, rid: str, kind: str, status: str, meta: dict[str, Any], *, created_at: float | None = None) -> None:
        """A new row owned by this process (no files yet)."""
        safe_name(rid)
        with self._tx() as db:
            db.execute(
                f"INSERT INTO results ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, NULL, NULL, 0, '[]', ?)",
                (rid, kind, status, self.owner, created_at or self.clock(), json.dumps(meta)),
            )

    def update_live(self, rid: str, *, status: str | None = None, meta: dict[str, Any] | None = None) -> bool:
        """Change a live row's status/meta; False when the row is gone or already finished."""
        sets, args = [], []
        if status is not None:
            sets.append("status = ?")
            args.append(status)
        if meta is not None:
            sets.append("meta = ?")
            args.append(json.dumps(meta))
        if not sets:
            return False
        with self._tx() as db:
            cursor = db.execute(
                f"UPDATE results SET {', '.join(sets)} WHERE id = ? AND status IN (?, ?)", (*args, rid, *LIVE_STATUSES)
            )
            return cursor.rowcount == 1

    def finish(self, rid: str, status: str, meta: dict[str, Any], files: dict[str, bytes] | None = None) -> bool:
        """Move a live row to a final status (with its files). False (and no files left behind) when the
        row was already finished or deleted, e.g. cancelled by another replica."""
        files = files or {}
        size = self.media_backend.put(rid, files) if files else 0
        now = self.clock()
        try:
            with self._tx() as db:
                cursor = db.execute(
                    "UPDATE results SET status = ?, meta = ?, files = ?, bytes = ?, completed_at = ?, expires_at = ? "
                    "WHERE id = ? AND status IN (?, ?)",
                    (
                        status,
                        json.dumps(meta),
                        json.dumps(sorted(files)),
                        size,
                        now,
                        self.expiry(now),
                        rid,
                        *LIVE_STATUSES,
                    ),
                )
                done = cursor.rowcount == 1
                if done:
                    self.metadata.notify(db, rid)
        except BaseException:
            if files:  # no row names them: do not leave them for the sweep's grace period
                with contextlib.suppress(Exception):
                    self.media_backend.remove(rid)
            raise
        if not done and files:
            self.media_backend.remove(rid)
        return done

    def put_completed(self, rid: str, kind: str, meta: dict[str, Any], files: dict[str, bytes]) -> None:
        """A finished result in one go (the images of a url response)."""
        size = self.media_backend.put(rid, files)
        now = self.clock()
        with self._tx() as db:
            db.execute(
                f"INSERT INTO results ({_COLUMNS}) VALUES (?, ?, 'completed', ?, ?, ?, ?, ?, ?, ?)",
                (rid, kind, self.owner, now, now, self.expiry(now), size, json.dumps(list(files)), json.dumps(meta)),
            )

    def delete(self, rid: str) -> bool:
        with self._tx() as db:
            gone = db.execute("DELETE FROM results WHERE id = ?", (rid,)).rowcount == 1
            if gone:
                self.metadata.notify(db, rid)
        self.media_backend.remove(rid)
        return gone

    # -- reading -----------------------------------------------------------------------------------

    def get(self, rid: str) -> Record | None:
        """The row, unless it is gone or past its `expires_at` (expired is gone, even before the sweep)."""
        rows = self._query(f"SELECT {_COLUMNS} FROM results WHERE id = ? AND {_UNEXPIRED}", (rid, self.clock()))
        return _record(rows[0]) if rows else None

    def read_file(self, record: Record, name: str) -> bytes | None:
        """A file of a finished result; None when it is not there (never a half-written one)."""
        if name not in record.files:
            return None
        return self.media_backend.get(record.id, name)

    def presign(self, record: Record, name: str, expires_s: int) -> str | None:
        """A URL the client may fetch the file from directly (None where the media store cannot sign)."""
        if name not in record.files:
            return None
        return self.media_backend.presign(record.id, name, expires_s)

    def list(
        self, kind: str, *, limit: int, after: str | None = None, newest_first: bool = True
    ) -> tuple[list[Record], bool]:
        """Rows of `kind` newest (or oldest) first, after the row `after` (KeyError when it is unknown)."""
        bound = ""
        args: tuple = (kind,)
        if after is not None:
            seq = self._query("SELECT seq FROM results WHERE id = ? AND kind = ?", (after, kind))
            if not seq:
                raise KeyError(after)
            bound, args = (" AND seq < ?" if newest_first else " AND seq > ?"), (kind, seq[0][0])
        order = "DESC" if newest_first else "ASC"
        rows = self._query(
            f"SELECT {_COLUMNS} FROM results WHERE kind = ?{bound} AND {_UNEXPIRED} ORDER BY seq {order} LIMIT ?",
            (*args, self.clock(), limit + 1),
        )
        return [_record(r) for r in rows[:limit]], len(rows) > limit

    def count(self, kind: str) -> int:
        return self._query("SELECT COUNT(*) FROM results WHERE kind = ?", (kind,))[0][0]

    def total_bytes(self) -> int:
        return int(self._query("SELECT COALESCE(SUM(bytes), 0) FROM results")[0][0])

    # -- retention and recovery ----------------------------------------------------------------------

    def heartbeat(self) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO owners (owner, heartbeat_at) VALUES (?, ?) "
                "ON CONFLICT(owner) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
                (self.owner, self.clock()),
            )

    def fail_interrupted(self, error: dict[str, Any]) -> list[str]:
        """Fail every live row whose owner process is gone (known dead on this host, or its lease, the
        heartbeat, older than `heartbeat_stale_s`); returns their ids."""
        now = self.clock()
        beats = dict(self._query("SELECT owner, heartbeat_at FROM owners"))
        live = self._query("SELECT id, owner, meta FROM results WHERE status IN (?, ?)", LIVE_STATUSES)
        failed: list[str] = []
        for rid, owner_text, meta_text in live:
            if owner_text == self.owner:
                continue
            owner = Owner.parse(owner_text)
            stale = now - beats.get(owner_text, 0.0) > self.policy.heartbeat_stale_s
            if not (owner is None or owner.known_dead() or stale):
                continue
            meta = {**json.loads(meta_text), "error": error}
            with self._tx() as db:
                cursor = db.execute(
                    "UPDATE results SET status = 'failed', meta = ?, completed_at = ?, expires_at = ? "
                    "WHERE id = ? AND owner = ? AND status IN (?, ?)",
                    (json.dumps(meta), now, self.expiry(now), rid, owner_text, *LIVE_STATUSES),
                )
                if cursor.rowcount == 1:
                    failed.append(rid)
        if failed:
            logger.warning(
                "%d result(s) of a server process that died were marked failed (interrupted): %s",
                len(failed),
                ", ".join(failed),
            )
        return failed

    def evict(self, kind: str, keep: int, *, by_files: bool = False) -> list[str]:
        """Remove the oldest finished rows of `kind` while more than `keep` rows (or, with `by_files`,
        files) remain; live rows and the newest row are never removed."""
        rows = self._query("SELECT id, status, files FROM results WHERE kind = ? ORDER BY seq", (kind,))
        weights = [len(json.loads(files)) if by_files else 1 for _, _, files in rows]
        total = sum(weights)
        removed: list[str] = []
        for (rid, status, _), weight in list(zip(rows, weights, strict=True))[:-1]:
            if total <= keep:
                break
            if status in LIVE_STATUSES:
                continue
            self.delete(rid)
            total -= weight
            removed.append(rid)
        return removed

    def sweep(self, interrupted_error: dict[str, Any]) -> dict[str, list[str]]:
        """One pass: heartbeat, dead owners' live rows, then (on one process of the fleet at a time)
        expired rows, the byte budget and orphaned media."""
        self.heartbeat()
        report = {
            "interrupted": self.fail_interrupted(interrupted_error),
            "expired": [],
            "over_budget": [],
            "orphans": [],
        }
        with self.metadata.fleet_lock() as mine:
            if mine:
                self._retention(report)
        return report

    def _retention(self, report: dict[str, list[str]]) -> None:
        now = self.clock()
        expired = self._query(
            "SELECT id FROM results WHERE expires_at IS NOT NULL AND expires_at <= ? AND status NOT IN (?, ?)",
            (now, *LIVE_STATUSES),
        )
        for (rid,) in expired:
            self.delete(rid)
            report["expired"].append(rid)
        if self.policy.max_bytes > 0:
            total = self.total_bytes()
            if total > self.policy.max_bytes:
                rows = self._query(
                    "SELECT id, bytes FROM results WHERE status NOT IN (?, ?) AND bytes > 0 ORDER BY seq", LIVE_STATUSES
                )
                for rid, size in rows:
                    if total <= self.policy.max_bytes:
                        break
                    self.delete(rid)
                    total -= size
                    report["over_budget"].append(rid)
        if now - self._orphans_checked_at >= ORPHAN_SCAN_INTERVAL_S:
            # Listing every object (a bucket listing on S3) is the sweep's costliest part: not every pass.
            self._orphans_checked_at = now
            known = {r[0] for r in self._query("SELECT id FROM results")}
            report["orphans"] = self.media_backend.remove_orphans(known, now, ORPHAN_GRACE_S)

    # -- background sweep ------------------------------------------------------------------------------

    def start_sweeper(
        self, interval_s: float, interrupted_error: dict[str, Any], after_sweep: Callable[[], None] | None = None
    ) -> None:
        """Run `sweep` every `interval_s` seconds in a daemon thread (then `after_sweep`, if given)."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.sweep(interrupted_error)
                    for hook in ([after_sweep] if after_sweep is not None else []) + self._sweep_hooks:
                        hook()
                except StoreUnavailableError as exc:  # a store that is down: one line, no traceback
                    logger.warning("results sweep skipped: %s", exc.message)
                except Exception:  # noqa: BLE001 - retention must never take the server down
                    logger.exception("results sweep failed; retrying in %.0fs", interval_s)

        self._stop.clear()
        self._sweeper = threading.Thread(target=loop, name="diffuserve-results-sweep", daemon=True)
        self._sweeper.start()

    def stop_sweeper(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
            self._sweeper = None
