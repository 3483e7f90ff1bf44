"""The results store alone: atomic files, retention (TTL, byte cap, counts), dead owners, and several
processes writing one folder at once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from diffuserve.storage import ResultStore, RetentionPolicy
from diffuserve.storage.owners import Owner

INTERRUPTED = {"message": "died", "type": "server_error", "param": None, "code": "interrupted"}


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_finish_writes_files_before_the_row_and_a_finished_row_never_changes(tmp_path: Path):
    store = ResultStore(tmp_path)
    store.add("video_a", "video", "queued", {"progress": 0})
    assert store.update_live("video_a", status="in_progress", meta={"progress": 50})
    record = store.get("video_a")
    assert record.status == "in_progress" and record.meta == {"progress": 50} and record.files == []
    assert store.read_file(record, "video.mp4") is None, "a live job serves no file"
    assert store.finish("video_a", "completed", {"progress": 100}, {"video.mp4": b"mp4-bytes"})
    record = store.get("video_a")
    assert (record.status, record.bytes, record.files) == ("completed", 9, ["video.mp4"])
    assert store.read_file(record, "video.mp4") == b"mp4-bytes"
    assert list(store.tmp.iterdir()) == [], "nothing is left half-written under tmp/"
    # A late cancel (or a second finish) of a finished row changes nothing and leaves no file behind.
    assert not store.finish("video_a", "cancelled", {})
    assert not store.update_live("video_a", status="in_progress")
    assert store.get("video_a").status == "completed"
    # A file whose row was finished elsewhere first (cancelled by a replica) is removed again.
    store.add("video_b", "video", "queued", {})
    assert store.finish("video_b", "cancelled", {})
    assert not store.finish("video_b", "completed", {}, {"video.mp4": b"late"})
    assert not (store.media / "video_b").exists()


def test_ttl_sets_expires_at_and_the_sweep_removes_rows_and_files(tmp_path: Path):
    clock = FakeClock()
    store = ResultStore(tmp_path, RetentionPolicy(ttl_s=60), clock=clock)
    store.put_completed("img_1", "image", {}, {"0.png": b"png"})
    store.add("video_live", "video", "in_progress", {})
    assert store.get("img_1").expires_at == clock.now + 60
    assert store.get("video_live").expires_at is None
    clock.now += 59
    assert store.sweep(INTERRUPTED)["expired"] == []
    clock.now += 2
    assert store.get("img_1") is None, "expired is gone for readers even before the sweep"
    assert store.sweep(INTERRUPTED)["expired"] == ["img_1"]
    assert store.get("img_1") is None and not (store.media / "img_1").exists()
    assert store.get("video_live") is not None, "live results never expire"
    # ttl 0 = kept until removed.
    forever = ResultStore(tmp_path / "forever", RetentionPolicy(ttl_s=0), clock=clock)
    forever.put_completed("img_2", "image", {}, {"0.png": b"png"})
    assert forever.get("img_2").expires_at is None


def test_byte_cap_removes_the_oldest_finished_first(tmp_path: Path):
    store = ResultStore(tmp_path, RetentionPolicy(ttl_s=0, max_bytes=250))
    for i in range(4):
        store.put_completed(f"img_{i}", "image", {}, {"0.png": b"x" * 100})
    store.add("video_live", "video", "queued", {})
    report = store.sweep(INTERRUPTED)
    assert report["over_budget"] == ["img_0", "img_1"]
    assert store.total_bytes() == 200 and store.get("img_2") and store.get("img_3")
    assert sorted(p.name for p in store.media.iterdir()) == ["img_2", "img_3"]


def test_count_eviction_by_rows_and_by_files_keeps_live_and_newest(tmp_path: Path):
    store = ResultStore(tmp_path)
    for i in range(3):
        store.put_completed(f"img_{i}", "image", {}, {"0.png": b"a", "1.png": b"b"})
    assert store.evict("image", 4, by_files=True) == ["img_0"]
    store.add("video_0", "video", "queued", {})
    store.add("video_1", "video", "queued", {})
    store.finish("video_1", "failed", {})
    store.add("video_2", "video", "queued", {})
    assert store.evict("video", 2) == ["video_1"]
    assert store.evict("video", 1) == [], "live rows stay even past the cap"


def test_live_rows_of_a_dead_process_fail_interrupted_and_of_a_live_one_stay(tmp_path: Path):
    store = ResultStore(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_owner = Owner(host=socket.gethostname(), pid=int(dead.stdout), start="1")
    live_owner = Owner.current()
    assert dead_owner.known_dead() and not live_owner.known_dead()
    store.add("video_dead", "video", "in_progress", {"progress": 40})
    store.add("video_other", "video", "queued", {})
    with store._tx() as db:
        db.execute("UPDATE results SET owner = ? WHERE id = 'video_dead'", (str(dead_owner),))
        # A neighbour that is alive (same host, live pid) with a fresh heartbeat.
        db.execute(
            "UPDATE results SET owner = ? WHERE id = 'video_other'",
            (f"{live_owner.host}@{live_owner.pid}:{live_owner.start}",),
        )
    reopened = ResultStore(tmp_path)  # what a restarted server does first
    assert reopened.fail_interrupted(INTERRUPTED) == ["video_dead"]
    record = reopened.get("video_dead")
    assert record.status == "failed" and record.meta == {"progress": 40, "error": INTERRUPTED}
    assert record.expires_at is not None
    assert reopened.get("video_other").status == "queued"


_WRITER = """
import sys
from diffuserve.storage import ResultStore
store = ResultStore(sys.argv[1])
for i in range(40):
    rid = f"{sys.argv[2]}_{i}"
    store.add(rid, "video", "queued", {"i": i})
    store.update_live(rid, status="in_progress", meta={"i": i, "progress": 50})
    store.finish(rid, "completed", {"i": i}, {"video.mp4": rid.encode() * 100})
    store.put_completed(f"img_{rid}", "image", {}, {"0.png": rid.encode()})
"""


def test_several_processes_share_one_folder(tmp_path: Path):
    root = tmp_path / "shared"
    ResultStore(root)  # create the schema once, as the first server would
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(root), name], stderr=subprocess.PIPE)
        for name in ("a", "b", "c")
    ]
    for writer in writers:
        assert writer.wait(120) == 0, writer.stderr.read().decode()
    store = ResultStore(root)
    assert store.count("video") == 120 and store.count("image") == 120
    for name in ("a", "b", "c"):
        record = store.get(f"{name}_39")
        assert record.status == "completed" and store.read_file(record, "video.mp4") == f"{name}_39".encode() * 100
    page, more = store.list("video", limit=200)
    assert len(page) == 120 and not more
    assert json.loads(json.dumps(page[0].meta)) == page[0].meta


def test_a_folder_from_before_schema_versions_is_version_1_and_a_newer_one_is_refused(tmp_path: Path):
    import sqlite3

    import pytest

    from diffuserve.errors import ConfigError
    from diffuserve.storage.metadata import SCHEMA_VERSION, SQLITE_MIGRATIONS

    with sqlite3.connect(tmp_path / "results.db") as conn:  # what a release without versions wrote
        conn.executescript(SQLITE_MIGRATIONS[1])
        conn.execute(
            "INSERT INTO results (id, kind, status, owner, created_at) VALUES ('img_old', 'image', "
            "'completed', 'h@1:1', 1.0)"
        )
    store = ResultStore(tmp_path)
    assert store.get("img_old").status == "completed"
    assert store._query("PRAGMA user_version")[0][0] == SCHEMA_VERSION
    store.close()
    with sqlite3.connect(tmp_path / "results.db") as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(ConfigError, match=f"version {SCHEMA_VERSION + 1}, newer than version {SCHEMA_VERSION}"):
        ResultStore(tmp_path)
