"""The soak of benchmarks/soak.py for 60 seconds (issue 34): the same code as the 15-minute run, on the session's tiny
checkpoints and its PostgreSQL + SeaweedFS S3 stores (the fault freezes both with SIGSTOP for 3 s, halfway).

A 60-second run is too short for the 5 % RSS goal to mean much on a shared machine (the warm-up is 12 s), so this
test holds the soak to the goals that are exact at any length: nothing lost, no 5xx outside the fault window, no
unexpected 4xx, every kind answered, every server drained with exit 0, and the fault really ran. RSS and fds are
reported, and held only to a loose bound here (a leak per request would still show)."""

from __future__ import annotations

import http.client
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import soak  # noqa: E402
from soak_kinds import KINDS  # noqa: E402
from soak_report import Limits, table  # noqa: E402


@pytest.mark.filterwarnings("ignore:The Sora API")
def test_a_60_second_soak_loses_nothing(
    tiny_flux_path, tiny_wan_path, tiny_checkpoint, postgres_server, s3_server, tmp_path: Path
):
    from diffuserve.lora.tiny import write_random_lora

    checkpoints = {"flux": tiny_flux_path, "wan": tiny_wan_path, "hunyuan3d": tiny_checkpoint("hunyuan3d")}
    loras = {
        name: write_random_lora(tiny_flux_path, tmp_path / name, seed=seed) for seed, name in ((1, "ink"), (2, "oil"))
    }
    config = soak.SoakConfig(
        duration_s=60,
        concurrency=3,
        fault_s=3,
        sample_s=1,
        job_timeout_s=90,
        work_dir=tmp_path,
        limits=Limits(rss_growth_max=0.25, fd_growth_max=16),
    )
    report = soak.run(config, soak.SharedStore(postgres_server, s3_server), checkpoints, loras)
    print(table(report))

    assert report["fault"] and report["fault"]["resumed_at"] > report["fault"]["stopped_at"], report["fault"]
    assert report["outcomes"]["lost"] == 0, report["findings"]
    assert not report["ledger"], report["ledger"]
    failed = {g["goal"]: g["value"] for g in report["goals"] if not g["ok"]}
    assert not failed, failed
    answered = {k for k, e in report["kinds"].items() if e["outcomes"].get("ok") or e["outcomes"].get("cancelled")}
    assert answered >= set(KINDS) - {"disconnect"}, report["kinds"]
    assert {"image", "video", "mesh"} == set(report["servers"]), report["servers"]
    assert all(e["samples"] >= 30 for e in report["servers"].values()), report["servers"]


def test_an_idle_connection_outlives_the_clients_idle_expiry(singleton_server):
    """httpx and the openai SDK keep an idle connection 5 s; the server keeps it longer (server/runner.py
    KEEP_ALIVE_S), so it is always the client that closes it. With uvicorn's 5 s the two expired together, and the
    soak lost an edit sent on a connection the server was closing."""
    conn = http.client.HTTPConnection("127.0.0.1", singleton_server.port, timeout=30)
    try:
        conn.request("GET", "/liveness")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        time.sleep(7)  # past the client's 5 s idle expiry
        conn.request("GET", "/liveness")
        answer = conn.getresponse()  # RemoteDisconnected when the server closed the connection meanwhile
        assert answer.status == 200 and conn.sock is first, "the request went out on the same idle connection"
    finally:
        conn.close()
