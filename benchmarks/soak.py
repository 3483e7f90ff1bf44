"""A soak: a mixed workload for a set duration against real servers on free loopback ports, checking that nothing is
lost, nothing fails outside an injected fault, and nothing grows (issue 34).

Three `diffuserve serve` processes (one model each): the tiny FLUX.1 checkpoint with two LoRA adapters (images in
three sizes, a url one among them, edits, streams, LoRA rows, step-cached rows, client disconnects), a tiny Wan2.1
(video jobs) and a tiny Hunyuan3D-2 (mesh jobs, octree 32), all on one results store. `--concurrency` client
threads walk the schedule of `soak_kinds.py` until `--duration-s` has passed (requests already sent finish and are
counted, bounded by `--job-timeout-s`). Halfway through, the store is frozen for `--fault-s` with SIGSTOP, then
SIGCONT: with `--store shared` (default) every PostgreSQL process and the SeaweedFS S3 server; with `--store local`
(SQLite + files inside each server process) the video server process itself, the one whose store the video
pollers read. 5xx answers of requests that overlap that window are counted apart. A sampler reads every server's
RSS and open file descriptors (psutil, children included) every `--sample-s`.

Goals (exit 1 when one is missed): 0 lost requests (every request answered once, every completed job downloads and
decodes with Pillow / PyAV / trimesh, every job the servers list is finished), 0 5xx outside the fault window, no
4xx but 429, every kind answered, per server RSS growth <= 5 % and open fds flat (medians of the window after the
warm-up against the last window; soak_report.py). Prints a table; `--json PATH` writes the whole report.

    PYTHONPATH=src .venv/bin/python benchmarks/soak.py --duration-s 900 --json soak.json
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from soak_kinds import SCHEDULE, Clients, Record, run_one  # noqa: E402
from soak_report import Limits, Sample, build, table  # noqa: E402

from tests.serverproc import ServerProcess  # noqa: E402
from tests.stores import S3_ENV, PostgresServer, SeaweedS3, postgres_bin, weed_bin  # noqa: E402

warnings.filterwarnings("ignore", "The Sora API", DeprecationWarning)  # the SDK's notice on every videos.* call


@dataclass
class SoakConfig:
    duration_s: float = 900.0
    concurrency: int = 4
    fault_at_share: float = 0.5
    fault_s: float = 5.0
    sample_s: float = 2.0
    job_timeout_s: float = 180.0
    max_requests: int = 100_000
    """A bound on the count as well as the time."""
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="diffuserve-soak-")))
    limits: Limits = field(default_factory=Limits)
    server_env: dict[str, str] = field(default_factory=dict)
    """More environment for the servers (e.g. allocator settings to compare)."""


class SharedStore:
    """PostgreSQL + SeaweedFS S3 (tests/stores.py); each server gets its own database and bucket prefix."""

    name = "PostgreSQL + SeaweedFS S3 (fault: SIGSTOP of every PostgreSQL process and of the S3 server)"

    def __init__(self, pg: PostgresServer, s3: SeaweedS3):
        self.pg, self.s3 = pg, s3
        self._stopped: list[psutil.Process] = []

    def flags(self) -> list[str]:
        return [
            *("--results-db", self.pg.new_database(), "--media-store", self.s3.new_store_url()),
            *("--s3-endpoint-url", self.s3.endpoint),
        ]

    def pause(self, servers: dict[str, ServerProcess]) -> str:
        postmaster = psutil.Process(int((self.pg.data / "postmaster.pid").read_text().split()[0]))
        weed = psutil.Process(self.s3.proc.pid)
        self._stopped = [postmaster, *postmaster.children(recursive=True), weed, *weed.children(recursive=True)]
        for proc in self._stopped:
            proc.send_signal(signal.SIGSTOP)
        return f"SIGSTOP: {len(self._stopped) - 1} PostgreSQL processes and the SeaweedFS server"

    def resume(self) -> None:
        for proc in self._stopped:
            proc.send_signal(signal.SIGCONT)


class LocalStore:
    """SQLite + files under each server's --output-dir: the store lives inside the server process."""

    name = "SQLite + files (fault: SIGSTOP of the video server process, which holds its store)"

    def __init__(self) -> None:
        self._stopped: psutil.Process | None = None

    def flags(self) -> list[str]:
        return []

    def pause(self, servers: dict[str, ServerProcess]) -> str:
        self._stopped = psutil.Process(servers["video"].proc.pid)
        self._stopped.send_signal(signal.SIGSTOP)
        return "SIGSTOP: the video server"

    def resume(self) -> None:
        if self._stopped is not None:
            self._stopped.send_signal(signal.SIGCONT)


def server_args(checkpoints: dict[str, Path], loras: dict[str, Path]) -> dict[str, list[str]]:
    """What each server runs: dynamic batching, as production would, with the retention defaults."""
    batching = ["--batching-mode", "dynamic", "--batching-delay-ms", "20"]
    return {
        "image": [
            *("--model-path", str(checkpoints["flux"]), "--served-model-name", "soak-flux", *batching),
            *("--batching-max-size", "4", "--result-cache-mib", "1", "--max-inference-steps", "64"),
            *("--lora-modules", *(f"{name}={path}" for name, path in loras.items())),
        ],
        "video": [
            *("--model-path", str(checkpoints["wan"]), "--served-model-name", "soak-wan", *batching),
            *("--batching-max-size", "2", "--max-inference-steps", "64"),
        ],
        "mesh": [
            *("--model-path", str(checkpoints["hunyuan3d"]), "--served-model-name", "soak-h3d", *batching),
            *("--batching-max-size", "2", "--max-octree-resolution", "64", "--max-inference-steps", "64"),
        ],
    }


def start_servers(args: dict[str, list[str]], store, work: Path, more_env: dict) -> dict[str, ServerProcess]:
    env = {**S3_ENV, "OMP_NUM_THREADS": "1", **more_env}
    servers = {}
    for name, flags in args.items():
        (work / name).mkdir(parents=True, exist_ok=True)
        servers[name] = ServerProcess([*flags, *store.flags()], work / name / "server.log", env=env)
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(s.start, timeout_s=300) for s in servers.values()]:
            future.result()
    return servers


def _png(mode: str, draw: Callable) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new(mode, (96, 80) if mode == "RGBA" else (64, 64), (0, 0, 0, 0) if mode == "RGBA" else (30, 90, 160))
    draw(ImageDraw.Draw(image))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def make_clients(servers: dict[str, ServerProcess], config: SoakConfig) -> Clients:
    def sdk(name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{servers[name].base_url}/v1", api_key="unused", timeout=120, max_retries=0)

    return Clients(
        images=sdk("image"),
        videos=sdk("video"),
        meshes=httpx.Client(base_url=servers["mesh"].base_url, timeout=120),
        plain=httpx.Client(timeout=120),
        edit_png=_png("RGB", lambda d: d.rectangle((16, 16, 48, 48), fill=(220, 200, 40))),
        object_png=_png("RGBA", lambda d: d.ellipse((20, 10, 70, 70), fill=(200, 50, 50, 255))),
        job_timeout_s=config.job_timeout_s,
    )


def sample(servers: dict[str, ServerProcess], at: float) -> list[Sample]:
    out = []
    for name, server in servers.items():
        try:
            proc = psutil.Process(server.proc.pid)
            family = [proc, *proc.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in family)
            fds = sum(p.num_fds() for p in family)
            threads = sum(p.num_threads() for p in family)
        except psutil.Error:
            continue  # it exited: the ledger says so
        out.append(Sample(name, round(at, 2), rss, fds, threads, os.getloadavg()[0]))
    return out


class Run:
    """The workers, the sampler and the fault of one soak, sharing the run's clock."""

    def __init__(self, config: SoakConfig, servers: dict[str, ServerProcess], store, clients: Clients):
        self.config, self.servers, self.store, self.clients = config, servers, store, clients
        self.t0 = time.monotonic()
        self.records: list[Record] = []
        self.samples: list[Sample] = []
        self.fault: dict | None = None
        self.done = threading.Event()
        self._seeds = itertools.count(1)
        self._turns: dict[str, int] = {}
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def worker(self, index: int) -> None:
        position = index * len(SCHEDULE) // self.config.concurrency
        while self.now() < self.config.duration_s:
            kind = SCHEDULE[position % len(SCHEDULE)]
            position += 1
            with self._lock:
                seed = next(self._seeds)
                if seed > self.config.max_requests:
                    return
                turn = self._turns[kind] = self._turns.get(kind, -1) + 1
            record = run_one(self.clients, kind, seed, self.t0, turn)
            with self._lock:
                self.records.append(record)

    def sampler(self) -> None:
        while not self.done.is_set():
            self.samples += sample(self.servers, self.now())
            self.done.wait(self.config.sample_s)

    def injector(self) -> None:
        if self.done.wait(self.config.duration_s * self.config.fault_at_share):
            return
        stopped_at = self.now()
        what = self.store.pause(self.servers)
        try:
            time.sleep(self.config.fault_s)
        finally:
            self.store.resume()
        self.fault = {"what": what, "stopped_at": round(stopped_at, 2), "resumed_at": round(self.now(), 2)}

    def go(self) -> None:
        helpers = [threading.Thread(target=f, daemon=True) for f in (self.sampler, self.injector)]
        for thread in helpers:
            thread.start()
        try:
            with ThreadPoolExecutor(self.config.concurrency) as pool:
                for future in [pool.submit(self.worker, i) for i in range(self.config.concurrency)]:
                    future.result()
        finally:
            self.done.set()
            for thread in helpers:
                thread.join()
            self.samples += sample(self.servers, self.now())


def ledger(servers: dict[str, ServerProcess], clients: Clients) -> tuple[list[str], dict]:
    """Server-side checks after the run: every job the video and mesh servers list is finished and listed once,
    and `/metrics` requests_total by endpoint and status (reported, to set beside the client's counts)."""
    findings: list[str] = []
    videos = [job.model_dump() for job in clients.videos.videos.list(limit=100)]
    meshes, after = [], None
    while True:
        page = clients.meshes.get("/v1/meshes", params={"limit": 100, **({"after": after} if after else {})}).json()
        meshes += page["data"]
        if not page.get("has_more"):
            break
        after = page["last_id"]
    for what, jobs in (("video", videos), ("mesh", meshes)):
        ids = [job["id"] for job in jobs]
        if len(ids) != len(set(ids)):
            findings.append(f"{what} listing has duplicate ids")
        findings += [
            f"{what} job {j['id']} is still {j['status']} after the run"
            for j in jobs
            if j["status"] not in ("completed", "failed", "cancelled")
        ]
    metrics = {}
    for name, server in servers.items():
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        metrics[name] = {
            line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("diffuserve_requests_total{")
        }
    return findings, {"listed_jobs": {"video": len(videos), "mesh": len(meshes)}, "requests_total": metrics}


def stop_servers(servers: dict[str, ServerProcess]) -> list[str]:
    """SIGTERM each server (a graceful drain); a non-zero exit or a traceback in a log is a finding."""
    findings = []
    for name, server in servers.items():
        code = server.stop(timeout_s=90)
        if code != 0:
            findings.append(f"{name} server exited {code} on SIGTERM")
        log = server.log()
        for marker in ("Traceback", " ERROR "):
            count = log.count(marker)
            if count:
                first = log[log.index(marker) :].splitlines()[0:3]
                findings.append(f"{name} server log has {count} x {marker.strip()!r}, first: {' | '.join(first)}")
    return findings


def run(config: SoakConfig, store, checkpoints: dict[str, Path], loras: dict[str, Path]) -> dict:
    """Start the servers on `store`, run the workload, stop them; returns the report (soak_report.build)."""
    args = server_args(checkpoints, loras)
    begun = time.monotonic()
    servers = start_servers(args, store, config.work_dir, config.server_env)
    start_s = round(time.monotonic() - begun, 1)
    findings: list[str] = []
    extra: dict = {}
    try:
        clients = make_clients(servers, config)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        load = os.getloadavg()
        soak = Run(config, servers, store, clients)
        soak.go()
        findings, extra = ledger(servers, clients)
    finally:
        findings += stop_servers(servers)
    meta = {
        "duration_s": config.duration_s,
        "wall_s": round(soak.now(), 1),
        "store": store.name,
        "concurrency": config.concurrency,
        "started_utc": started,
        "cpus": os.cpu_count(),
        "load_at_start": [round(x, 2) for x in load],
        "load_at_end": [round(x, 2) for x in os.getloadavg()],
        "server_args": args,
        "server_env": config.server_env,
        "work_dir": str(config.work_dir),
        "servers_start_s": start_s,
        **extra,
    }
    return build(soak.records, soak.samples, soak.fault, meta, config.limits, findings)


def _checkpoints(work: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """The tiny checkpoints and two random rank-4 LoRA adapters of the FLUX one, built into `work`."""
    from diffuserve.lora.tiny import write_random_lora
    from diffuserve.models.tiny import build_tiny_checkpoint

    checkpoints = {name: build_tiny_checkpoint(name, work / f"{name}-tiny") for name in ("flux", "wan", "hunyuan3d")}
    loras = {
        name: write_random_lora(checkpoints["flux"], work / f"lora-{name}", seed=seed)
        for seed, name in ((1, "ink"), (2, "oil"))
    }
    return checkpoints, loras


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=900.0, help="how long requests are sent (default 900)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    parser.add_argument(
        "--store", choices=("shared", "local"), default="shared", help="PostgreSQL + S3, or SQLite + files"
    )
    parser.add_argument(
        "--fault-s", type=float, default=5.0, help="seconds the store is stopped, halfway (0 = no fault)"
    )
    parser.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS / fd samples")
    parser.add_argument("--job-timeout-s", type=float, default=180.0, help="longest wait for one video / mesh job")
    parser.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests too")
    parser.add_argument("--work-dir", type=Path, help="checkpoints, logs and stores (default: a new temp dir)")
    parser.add_argument("--server-env", nargs="+", default=[], metavar="KEY=VALUE", help="more server environment")
    parser.add_argument("--json", type=Path, help="write the whole report (samples included) here")
    opts = parser.parse_args(argv)
    if opts.duration_s <= 0 or opts.concurrency < 1:
        parser.error("--duration-s must be > 0 and --concurrency >= 1")
    if any("=" not in item for item in opts.server_env):
        parser.error("--server-env takes KEY=VALUE items, e.g. MALLOC_ARENA_MAX=2")
    config = SoakConfig(
        duration_s=opts.duration_s,
        concurrency=opts.concurrency,
        fault_s=opts.fault_s,
        fault_at_share=0.5 if opts.fault_s > 0 else 2.0,
        sample_s=opts.sample_s,
        job_timeout_s=opts.job_timeout_s,
        max_requests=opts.max_requests,
        server_env=dict(item.split("=", 1) for item in opts.server_env),
        **({"work_dir": opts.work_dir} if opts.work_dir else {}),
    )
    config.work_dir.mkdir(parents=True, exist_ok=True)
    checkpoints, loras = _checkpoints(config.work_dir)
    pg = s3 = None
    try:
        if opts.store == "shared":
            if postgres_bin() is None or weed_bin() is None:
                parser.error("--store shared needs PostgreSQL (initdb) and SeaweedFS (weed); or use --store local")
            os.environ.update(S3_ENV)
            pg, s3 = PostgresServer(postgres_bin()).start(), SeaweedS3(weed_bin()).start()
        report = run(config, SharedStore(pg, s3) if pg else LocalStore(), checkpoints, loras)
    finally:
        for server in (pg, s3):
            if server is not None:
                server.stop()
    print(table(report))
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
