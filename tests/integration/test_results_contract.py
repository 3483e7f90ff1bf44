"""One contract for every results store: SQLite + files, PostgreSQL + files, SQLite + S3, PostgreSQL + S3.

Real servers (tests/stores.py): a throwaway PostgreSQL cluster and a SeaweedFS S3 server per session, a
fresh database and bucket per test. The same assertions hold for every combination: media written before
the row, a finished row never changes, retention (TTL, byte cap, counts) removes rows and media together,
dead owners' jobs fail `interrupted`, orphans go after the grace period, several processes share a store.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from diffuserve.errors import ConfigError
from diffuserve.storage import ResultStore, RetentionPolicy
from diffuserve.storage.media import StoreUnavailableError
from diffuserve.storage.metadata import SCHEMA_VERSION
from diffuserve.storage.open import open_results
from diffuserve.storage.owners import Owner
from diffuserve.storage.results import ORPHAN_GRACE_S

INTERRUPTED = {"message": "died", "type": "server_error", "param": None, "code": "interrupted"}
COMBOS = ["sqlite+files", "postgres+files", "sqlite+s3", "postgres+s3"]


class FakeClock:
    def __init__(self, now: float | None = None):
        import time

        self.now = now or time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=COMBOS)
def make_store(request, tmp_path: Path):
    """`make_store(policy=..., clock=...)` -> a ResultStore on this test's stores (several calls share them,
    like several processes would)."""
    db, media = request.param.split("+")
    urls: dict[str, str | None] = {"results_db": None, "media_store": None, "s3_endpoint_url": None}
    if db == "postgres":
        urls["results_db"] = request.getfixturevalue("postgres_server").new_database()
    if media == "s3":
        s3 = request.getfixturevalue("s3_server")
        urls.update(media_store=s3.new_store_url(), s3_endpoint_url=s3.endpoint)
    opened: list[ResultStore] = []

    def make(policy: RetentionPolicy | None = None, clock=None) -> ResultStore:
        store = open_results(tmp_path / "outputs", policy or RetentionPolicy(), **urls)
        if clock is not None:
            store.clock = clock
        opened.append(store)
        return store

    make.urls = urls  # type: ignore[attr-defined]
    make.root = tmp_path / "outputs"  # type: ignore[attr-defined]
    yield make
    for store in opened:
        store.close()


def _listed(store: ResultStore) -> set[str]:
    media = store.media_backend
    if store.media is not None:
        return {p.name for p in store.media.iterdir()}
    return {obj["Key"][len(media.prefix) :].partition("/")[0] for obj in media._objects(media.prefix)}  # type: ignore[attr-defined]


def test_media_first_then_the_row_and_a_finished_row_never_changes(make_store):
    store = make_store()
    store.add("video_a", "video", "queued", {"progress": 0})
    assert store.update_live("video_a", status="in_progress", meta={"progress": 50})
    record = store.get("video_a")
    assert record.status == "in_progress" and record.meta == {"progress": 50} and record.files == []
    assert store.read_file(record, "video.mp4") is None, "a live job serves no file"
    assert store.finish("video_a", "completed", {"progress": 100}, {"video.mp4": b"mp4-bytes"})
    record = store.get("video_a")
    assert (record.status, record.bytes, record.files) == ("completed", 9, ["video.mp4"])
    assert store.read_file(record, "video.mp4") == b"mp4-bytes"
    assert not store.finish("video_a", "cancelled", {})
    assert not store.update_live("video_a", status="in_progress")
    assert store.get("video_a").status == "completed"
    # A file whose row was finished elsewhere first (cancelled by a replica) is removed again.
    store.add("video_b", "video", "queued", {})
    assert store.finish("video_b", "cancelled", {})
    assert not store.finish("video_b", "completed", {}, {"video.mp4": b"late"})
    assert _listed(store) == {"video_a"}
    # Another process (replica) reads the same rows and media.
    other = make_store()
    assert other.read_file(other.get("video_a"), "video.mp4") == b"mp4-bytes"
    assert other.delete("video_a") and store.get("video_a") is None and _listed(store) == set()


def test_list_pages_by_after_and_order(make_store):
    store = make_store()
    for i in range(5):
        store.add(f"video_{i}", "video", "queued", {"i": i})
    store.put_completed("img_0", "image", {}, {"0.png": b"png"})
    page, more = store.list("video", limit=2)
    assert [r.id for r in page] == ["video_4", "video_3"] and more
    page, more = store.list("video", limit=3, after="video_3")
    assert [r.id for r in page] == ["video_2", "video_1", "video_0"] and not more
    page, more = store.list("video", limit=10, after="video_1", newest_first=False)
    assert [r.id for r in page] == ["video_2", "video_3", "video_4"] and not more
    with pytest.raises(KeyError):
        store.list("video", limit=2, after="img_0")
    assert store.count("video") == 5 and store.count("image") == 1


def test_ttl_expiry_and_the_byte_cap_remove_rows_and_media_together(make_store):
    clock = FakeClock()
    store = make_store(RetentionPolicy(ttl_s=60, max_bytes=250), clock)
    store.put_completed("img_old", "image", {}, {"0.png": b"o" * 10})
    store.add("video_live", "video", "in_progress", {})
    assert store.get("img_old").expires_at == clock.now + 60 and store.get("video_live").expires_at is None
    clock.now += 61
    assert store.get("img_old") is None, "expired is gone for readers even before the sweep"
    for i in range(4):
        store.put_completed(f"img_{i}", "image", {}, {"0.png": b"x" * 100})
    report = store.sweep(INTERRUPTED)
    assert report["expired"] == ["img_old"] and report["over_budget"] == ["img_0", "img_1"]
    assert store.total_bytes() == 200 and _listed(store) == {"img_2", "img_3"}
    assert store.get("video_live") is not None, "live results never expire"


def test_count_eviction_by_rows_and_by_files_keeps_live_and_newest(make_store):
    store = make_store()
    for i in range(3):
        store.put_completed(f"img_{i}", "image", {}, {"0.png": b"a", "1.png": b"b"})
    assert store.evict("image", 4, by_files=True) == ["img_0"]
    store.add("video_0", "video", "queued", {})
    store.add("video_1", "video", "queued", {})
    store.finish("video_1", "failed", {})
    store.add("video_2", "video", "queued", {})
    assert store.evict("video", 2) == ["video_1"]
    assert store.evict("video", 1) == [], "live rows stay even past the cap"


def test_dead_owners_and_expired_leases_fail_interrupted(make_store):
    clock = FakeClock()
    store = make_store(RetentionPolicy(heartbeat_stale_s=30), clock)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_owner = Owner(host=socket.gethostname(), pid=int(dead.stdout), start="1")
    live = Owner.current()
    for rid, owner in [
        ("video_dead", str(dead_owner)),
        ("video_neighbour", f"{live.host}@{live.pid}:{live.start}"),
        ("video_far_fresh", "other-host@7:1"),
        ("video_far_stale", "gone-host@7:1"),
    ]:
        store.add(rid, "video", "in_progress", {"progress": 40})
        with store._tx() as db:
            db.execute("UPDATE results SET owner = ? WHERE id = ?", (owner, rid))
    with store._tx() as db:  # leases: one renewed now, one 31 s ago
        db.execute("INSERT INTO owners (owner, heartbeat_at) VALUES (?, ?)", ("other-host@7:1", clock.now))
        db.execute("INSERT INTO owners (owner, heartbeat_at) VALUES (?, ?)", ("gone-host@7:1", clock.now - 31))
    replica = make_store(RetentionPolicy(heartbeat_stale_s=30), clock)
    assert sorted(replica.fail_interrupted(INTERRUPTED)) == ["video_dead", "video_far_stale"]
    record = replica.get("video_dead")
    assert record.status == "failed" and record.meta == {"progress": 40, "error": INTERRUPTED}
    assert record.expires_at is not None
    assert replica.get("video_neighbour").status == replica.get("video_far_fresh").status == "in_progress"


def test_the_sweep_leaves_no_row_without_media_and_no_media_without_a_row(make_store):
    clock = FakeClock()
    store = make_store(RetentionPolicy(ttl_s=0), clock)
    store.put_completed("img_kept", "image", {}, {"0.png": b"kept"})
    store.media_backend.put("img_orphan", {"0.png": b"no row names me"})  # a crash between upload and commit
    assert store.sweep(INTERRUPTED)["orphans"] == [], "a writer may still be about to commit"
    clock.now += ORPHAN_GRACE_S + 5
    assert store.sweep(INTERRUPTED)["orphans"] == ["img_orphan"]
    assert _listed(store) == {"img_kept"}
    for record in store.list("image", limit=10)[0]:
        assert all(store.read_file(record, name) is not None for name in record.files)


_WRITER = """
import json, sys
from pathlib import Path
from diffuserve.storage import RetentionPolicy
from diffuserve.storage.open import open_results
store = open_results(Path(sys.argv[1]), RetentionPolicy(), **json.loads(sys.argv[2]))
for i in range(15):
    rid = f"{sys.argv[3]}_{i}"
    store.add(rid, "video", "queued", {"i": i})
    store.update_live(rid, status="in_progress", meta={"i": i, "progress": 50})
    store.finish(rid, "completed", {"i": i}, {"video.mp4": rid.encode() * 100})
store.close()
"""


def test_several_processes_share_one_store(make_store):
    store = make_store()  # the schema once, as the first server would
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(make_store.root), json.dumps(make_store.urls), name],
            stderr=subprocess.PIPE,
        )
        for name in ("a", "b")
    ]
    for writer in writers:
        assert writer.wait(120) == 0, writer.stderr.read().decode()
    assert store.count("video") == 30
    for name in ("a", "b"):
        record = store.get(f"{name}_14")
        assert record.status == "completed" and store.read_file(record, "video.mp4") == f"{name}_14".encode() * 100
    assert len(store.list("video", limit=100)[0]) == 30


# -- what only the shared stores do ----------------------------------------------------------------------


def test_postgres_notifies_every_replica_and_sweeps_once_across_the_fleet(postgres_server, tmp_path: Path):
    url = postgres_server.new_database()
    owner = open_results(tmp_path / "a", RetentionPolicy(), results_db=url)
    other = open_results(tmp_path / "b", RetentionPolicy(), results_db=url)
    try:
        seen: list[str] = []
        arrived = threading.Event()
        owner.watch(lambda rid: (seen.append(rid), arrived.set()))
        owner.add("video_x", "video", "in_progress", {})
        assert owner.metadata.listening.wait(10), "the owner's LISTEN connection is up before the cancel"
        assert other.finish("video_x", "cancelled", {})  # a cancel sent to another replica
        assert arrived.wait(5), "the owner hears of the cancel without waiting for its sweep"
        assert seen == ["video_x"]
        with owner.metadata.fleet_lock() as mine, other.metadata.fleet_lock() as theirs:
            assert (mine, theirs) == (True, False), "retention runs on one replica at a time"
    finally:
        owner.close()
        other.close()


def test_a_schema_newer_than_the_code_refuses_to_start_naming_both_versions(postgres_server, tmp_path: Path):
    import psycopg

    url = postgres_server.new_database()
    open_results(tmp_path, RetentionPolicy(), results_db=url).close()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT max(version) FROM diffuserve_schema").fetchone()[0] == SCHEMA_VERSION
        conn.execute("INSERT INTO diffuserve_schema (version) VALUES (%s)", (SCHEMA_VERSION + 1,))
    with pytest.raises(ConfigError, match=f"--results-db.*version {SCHEMA_VERSION + 1}.*version {SCHEMA_VERSION}"):
        open_results(tmp_path, RetentionPolicy(), results_db=url)
    import sqlite3

    ResultStore(tmp_path / "lite").close()
    with sqlite3.connect(tmp_path / "lite" / "results.db") as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(ConfigError, match=f"--output-dir.*version {SCHEMA_VERSION + 1}"):
        ResultStore(tmp_path / "lite")


def test_bad_store_settings_fail_at_start_naming_the_flag(postgres_server, s3_server, tmp_path: Path):
    from tests.stores import free_port

    closed = free_port()
    with pytest.raises(ConfigError, match="--results-db postgresql://postgres:\\*\\*\\*@127.0.0.1.*cannot connect"):
        open_results(tmp_path, RetentionPolicy(), results_db=f"postgresql://postgres:secret@127.0.0.1:{closed}/x")
    with pytest.raises(ConfigError, match="--results-db.*cannot connect"):
        open_results(tmp_path, RetentionPolicy(), results_db=postgres_server.url.replace("/postgres", "/no_such_db"))
    with pytest.raises(
        ConfigError,
        match="--media-store s3://missing-bucket/p: bucket 'missing-bucket' does not "
        "exist.*--media-store-create-bucket",
    ):
        open_results(
            tmp_path, RetentionPolicy(), media_store="s3://missing-bucket/p", s3_endpoint_url=s3_server.endpoint
        )
    created = open_results(
        tmp_path,
        RetentionPolicy(),
        media_store="s3://made-at-start/p",
        s3_endpoint_url=s3_server.endpoint,
        create_bucket=True,
    )
    created.close()
    with pytest.raises(ConfigError, match="--media-store.*cannot reach the S3 server"):
        open_results(tmp_path, RetentionPolicy(), media_store="s3://b/p", s3_endpoint_url=f"http://127.0.0.1:{closed}")
    with pytest.raises(ConfigError, match="--media-store: 'http://x' is not an S3 URL"):
        open_results(tmp_path, RetentionPolicy(), media_store="http://x")


def test_a_store_that_goes_away_fails_requests_with_503_naming_it_then_recovers(
    postgres_server, s3_server, tmp_path: Path
):
    from tests.stores import TcpProxy

    db = TcpProxy(postgres_server.port)
    s3 = TcpProxy(s3_server.port)
    url = postgres_server.new_database().replace(f":{postgres_server.port}/", f":{db.port}/")
    store = open_results(
        tmp_path,
        RetentionPolicy(),
        results_db=url,
        media_store=s3_server.new_store_url(),
        s3_endpoint_url=f"http://127.0.0.1:{s3.port}",
    )
    try:
        store.put_completed("img_1", "image", {}, {"0.png": b"png"})
        record = store.get("img_1")
        s3.pause()
        with pytest.raises(StoreUnavailableError, match="--media-store s3://") as down:
            store.read_file(record, "0.png")
        assert down.value.http_status == 503
        s3.resume()
        assert store.read_file(record, "0.png") == b"png"
        db.pause()
        with pytest.raises(StoreUnavailableError, match="--results-db postgresql://"):
            store.get("img_1")
        db.resume()
        assert store.get("img_1").id == "img_1", "the pool reconnects once the database is back"
    finally:
        db.resume()
        store.close()
        db.close()
        s3.close()


def test_serve_with_an_unusable_store_exits_2_naming_the_flag(s3_server, tmp_path: Path):
    from tests.serverproc import free_port

    base = [
        sys.executable,
        "-m",
        "diffuserve.cli",
        "serve",
        "--port",
        str(free_port()),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    cases = [
        (["--results-db", "mysql://x"], "--results-db: 'mysql://x' is not a PostgreSQL URL"),
        (
            ["--media-store", "s3://no-such-bucket/p", "--s3-endpoint-url", s3_server.endpoint],
            "bucket 'no-such-bucket' does not exist",
        ),
    ]
    for flags, message in cases:
        out = subprocess.run(base + flags, capture_output=True, text=True, timeout=240)
        assert out.returncode == 2, out.stderr[-2000:]
        assert message in out.stderr


def test_url_images_resolve_on_another_replica_and_presign_to_the_bucket(postgres_server, s3_server, tmp_path: Path):
    import httpx

    from diffuserve.server.context import ImageStore, StoredImage

    urls = {
        "results_db": postgres_server.new_database(),
        "media_store": s3_server.new_store_url(),
        "s3_endpoint_url": s3_server.endpoint,
    }
    made_here, there = (open_results(tmp_path / name, RetentionPolicy(), **urls) for name in ("a", "b"))
    try:
        ImageStore(made_here, 8).put(
            "img_x", [StoredImage(b"png-0", "image/png"), StoredImage(b"webp-1", "image/webp")]
        )
        other = ImageStore(there, 8)
        assert [(i.data, i.media_type) for i in other.get("img_x")] == [
            (b"png-0", "image/png"),
            (b"webp-1", "image/webp"),
        ]
        url = other.presign("img_x", 1, 60)
        assert url.startswith(s3_server.endpoint) and httpx.get(url, timeout=30).content == b"webp-1"
        assert other.presign("img_x", 2, 60) is None and other.presign("img_nope", 0, 60) is None
    finally:
        made_here.close()
        there.close()
