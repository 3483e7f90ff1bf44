"""Poisson arrivals against singleton, dynamic (5 ms) and continuous servers, side by side in one run.

    .venv/bin/python benchmarks/bench_arrivals.py                         # tiny @64px and 36m @256px
    .venv/bin/python benchmarks/bench_arrivals.py --scenarios tiny --requests 40 --plot arrivals.png

Per scenario (a FLUX.1-style checkpoint built into a temp dir): start the three servers, measure singleton
capacity (closed loop, one client: requests / s), then at 30 / 50 / 70 / 90 % of that capacity send `--requests`
requests with Poisson arrivals (`diffuserve.bench.run_setting`, the same seeds for every server) to each server in
turn and print throughput and mean / p50 / p99 latency. Issue-10 targets: at 70 % load continuous mean latency
<= 0.7x dynamic and p99 <= dynamic; at saturation continuous throughput >= dynamic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from diffuserve.bench import BenchRequestSpec, run_setting

SERVERS = {
    "singleton": [],
    "dynamic": ["--batching-mode", "dynamic", "--batching-max-size", "8", "--batching-delay-ms", "5"],
    "continuous": ["--batching-mode", "continuous", "--batching-max-size", "8"],
}
SCENARIOS = {"tiny": ("tiny", "64x64", 4), "36m": ("36m", "256x256", 4)}
"""name -> (tiny-checkpoint preset, size, steps)."""
LOADS = (0.3, 0.5, 0.7, 0.9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "diffuserve.cli", "serve", "--model-path", str(model), "--port", str(port),
           "--max-queue-size", "0", "--output-dir", str(log.parent / f"out-{port}"), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while time.monotonic() - started < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"server not healthy: {log.read_text()[-2000:]}")


def run_scenario(name: str, num_requests: int, workdir: Path) -> dict[str, Any]:
    from diffuserve.models.tiny import build_tiny_checkpoint

    preset, size, steps = SCENARIOS[name]
    model = build_tiny_checkpoint("flux", workdir / f"flux-{preset}", preset=preset)
    spec = BenchRequestSpec(size=size, steps=steps)
    servers = {label: _start(model, extra, workdir / f"{name}-{label}.log") for label, extra in SERVERS.items()}
    try:
        urls = {label: url for label, (_, url) in servers.items()}
        for url in urls.values():  # warm every server the same way
            asyncio.run(run_setting(url, spec, concurrency=1, request_rate=math.inf, num_requests=3, seed=0,
                                    progress=False))
        capacity = asyncio.run(run_setting(urls["singleton"], spec, concurrency=1, request_rate=math.inf,
                                           num_requests=max(8, num_requests // 4), seed=1, progress=False))
        cap_rps = capacity["throughput_rps"]
        rows = []
        for load in LOADS:
            for label, url in urls.items():
                row = asyncio.run(run_setting(url, spec, concurrency=num_requests, request_rate=load * cap_rps,
                                              num_requests=num_requests, seed=1000, progress=False))
                rows.append({"load": load, "server": label, **row})
                print(_format_row(name, rows[-1]), flush=True)
        return {"scenario": name, "size": size, "steps": steps, "singleton_capacity_rps": cap_rps, "rows": rows}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)


def _format_row(scenario: str, row: dict[str, Any]) -> str:
    lat = row["latency_ms"]
    return (f"{scenario:5} load={row['load'] * 100:3.0f}% {row['server']:10} ok={row['completed']:3d} "
            f"fail={row['failed']} thr={row['throughput_rps']:.2f} req/s mean={lat['mean'] or 0:.0f}ms "
            f"p50={lat['p50'] or 0:.0f}ms p99={lat['p99'] or 0:.0f}ms")


def _plot(reports: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        for label in SERVERS:
            rows = [r for r in report["rows"] if r["server"] == label]
            ax.plot([r["load"] * 100 for r in rows], [r["latency_ms"]["mean"] for r in rows], "o-", label=f"{label} mean")
            ax.plot([r["load"] * 100 for r in rows], [r["latency_ms"]["p99"] for r in rows], "s--", label=f"{label} p99")
        ax.set(title=f"{report['scenario']} {report['size']}", xlabel="load (% of singleton capacity)", ylabel="ms")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["tiny", "36m"])
    parser.add_argument("--requests", type=int, default=40, help="Requests per load point and server.")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of latency against load (needs matplotlib).")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-arrivals-") as tmp:
        reports = [run_scenario(name, args.requests, Path(tmp)) for name in args.scenarios]
    for report in reports:
        print(f"{report['scenario']}: singleton capacity {report['singleton_capacity_rps']:.2f} req/s")
    if args.output_json:
        args.output_json.write_text(json.dumps(reports, indent=2))
    if args.plot:
        _plot(reports, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
