"""Poisson arrivals against singleton, dynamic (5 ms) and continuous servers, side by side in one run.

    .venv/bin/python benchmarks/bench_arrivals.py                      # tiny @64px and 36m @256px, full grid
    .venv/bin/python benchmarks/bench_arrivals.py --scenarios tiny --requests 40 --output-dir /tmp/arrivals

Per scenario (a FLUX.1-style checkpoint built into a temp dir: `tiny`, a ~72k-parameter transformer at 64px, or
`36m`, the ~36M-parameter preset of `models/tiny.py` at 256px): start the three servers, measure singleton
capacity (closed loop, one client: requests / s), then at 30 / 50 / 70 / 90 % of that capacity send the same
Poisson arrivals (same seeds) to each server in turn, and finally a saturation point: a closed loop of
`--saturation-concurrency` clients. The grid runs in `--rounds` rounds, each with a fresh capacity and a share of
the requests, and each point pools its rounds, so load from other processes hits every server alike. Prints throughput
and mean / p50 / p99 latency per point, and the issue-10
targets: at 70 % load continuous mean latency <= 0.7x dynamic and p99 <= dynamic; at saturation continuous
throughput >= dynamic. With `--output-dir`: `arrivals.txt` (the printed table), `arrivals.json` and
`arrivals.svg` (latency against load, drawn with matplotlib, which the dev environment has; SVG because it is
text, and the repository keeps no binaries). `--plot-from arrivals.json` redraws the SVG of a saved run.

The defaults are the whole grid. On a shared 2-core machine one 36m request takes tens of seconds, so a run that
must stay short cuts the 36m grid down (`--requests-36m`, `--loads-36m`, `--load-servers-36m`,
`--saturation-concurrency-36m`); a point's p99 over a handful of requests is its max.

`--simulate gpu cpu` runs no model and no server: the real engine and schedulers (singleton, dynamic 5 ms,
continuous, all at max size 8) drive a simulated accelerator whose denoising step of `rows` rows takes
`a + b x rows` seconds (`diffuserve/tools/sim_executor.py`: `gpu` a=40 ms, b=1 ms/row, b << a as on a GPU;
`cpu` the tiny model's measured 4.3 ms + 1.0 ms/row), with Poisson arrivals at `--loads` of the simulated
singleton capacity, `--sim-requests` per point. It prints mean / p50 / p99 latency per point and the 70 % targets;
with `--output-dir`, `simulate.txt`.

`--simulate gpu --mixed` instead compares size-grouped batching (today's: one size per batch) with token-budget
batches of mixed sizes and deficit round-robin (`--batching-max-tokens 8192 --batching-order drr` on a family that
packs mixed sizes), on a mixed-size workload (256x256, 384x512, 512x512, 512x768 drawn uniformly) and on the
one-shape workload (512x512): saturation throughput (a closed loop of `--mixed-clients`), then mean latency and the
p99 of the smallest size class under Poisson arrivals at 70 % of the size-grouped saturation throughput
(`diffuserve/tools/sim_mixed.py`), and issue 31's targets. `--mixed-fair-order` compares the fair order alone on
the mixed workload: `tokens (fifo)` against `tokens+drr`, both packing `--mixed-max-tokens`, at 70 % of
`tokens (fifo)`'s saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from diffuserve.tools.bench import BenchRequestSpec, _client, _drive, _send
from diffuserve.tools.bench_report import RequestResult, poisson_arrivals, summarize_setting

SERVERS = {
    "singleton": [],
    "dynamic": ["--batching-mode", "dynamic", "--batching-max-size", "8", "--batching-delay-ms", "5"],
    "continuous": ["--batching-mode", "continuous", "--batching-max-size", "8"],
}
LOADS = (0.3, 0.5, 0.7, 0.9)
COLORS = {"singleton": "tab:blue", "dynamic": "tab:orange", "continuous": "tab:green"}
SATURATION = "sat"
"""The load label of the closed-loop saturation point."""


@dataclass
class Scenario:
    preset: str
    """Tiny-checkpoint preset (`models/tiny.py`)."""
    size: str
    steps: int
    requests: int
    """Requests per load point and server."""
    loads: tuple[float, ...]
    load_servers: tuple[str, ...]
    """Servers measured at the load points (singleton always gives the capacity)."""
    saturation_concurrency: int
    """Clients of the closed-loop saturation point."""
    rounds: int
    """The grid is run this many times (each time with `requests / rounds` per point and a fresh capacity), and
    each point's figures pool its rounds: load from other processes then hits every server alike."""


def _scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    return {
        "tiny": Scenario(
            "tiny",
            "64x64",
            args.steps,
            args.requests,
            tuple(args.loads),
            tuple(args.load_servers),
            args.saturation_concurrency,
            args.rounds,
        ),
        "36m": Scenario(
            "36m",
            "256x256",
            args.steps,
            args.requests_36m,
            tuple(args.loads_36m),
            tuple(args.load_servers_36m),
            args.saturation_concurrency_36m,
            args.rounds_36m,
        ),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "diffuserve.cli",
        "serve",
        "--model-path",
        str(model),
        "--port",
        str(port),
        "--max-queue-size",
        "0",
        "--output-dir",
        str(log.parent / f"out-{port}"),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=os.environ.copy())
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    started = time.monotonic()
    while time.monotonic() - started < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not healthy: {log.read_text()[-2000:]}")


async def _requests(
    url: str, spec: BenchRequestSpec, *, rate: float, concurrency: int, requests: int, seed: int
) -> tuple[list[RequestResult], float]:
    """Raw results and duration of one batch of requests (closed loop when `rate` is inf, else Poisson)."""
    arrivals = None if math.isinf(rate) else poisson_arrivals(requests, rate, random.Random(seed))
    async with _client(url, None, spec.timeout_s, concurrency) as client:
        started = time.perf_counter()
        results = await _drive(
            lambda i: _send(client, spec, seed + i), requests, concurrency, arrivals, lambda _r: None
        )
        return results, time.perf_counter() - started


def run_scenario(name: str, scenario: Scenario, workdir: Path) -> dict[str, Any]:
    from diffuserve.models.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint("flux", workdir / f"flux-{scenario.preset}", preset=scenario.preset)
    spec = BenchRequestSpec(size=scenario.size, steps=scenario.steps)
    labels = ["singleton", *(s for s in SERVERS if s in scenario.load_servers and s != "singleton")]
    servers = {label: _start(model, SERVERS[label], workdir / f"{name}-{label}.log") for label in labels}
    try:
        for label, (proc, url) in servers.items():
            _wait_healthy(proc, url, workdir / f"{name}-{label}.log")
        urls = {label: url for label, (_, url) in servers.items()}
        for url in urls.values():  # warm every server the same way
            asyncio.run(_requests(url, spec, rate=math.inf, concurrency=1, requests=1, seed=0))
        saturation = scenario.saturation_concurrency
        points: list[Any] = [*scenario.loads, SATURATION]
        raw: dict[tuple[Any, str], tuple[list[RequestResult], float]] = {}
        capacities = []
        per_round = max(1, scenario.requests // scenario.rounds)
        for round_index in range(scenario.rounds):
            # Capacity again every round: the machine's speed moves with other work, and a load is a share of it.
            results, seconds = asyncio.run(
                _requests(
                    urls["singleton"],
                    spec,
                    rate=math.inf,
                    concurrency=1,
                    requests=max(2, per_round // 2),
                    seed=1 + round_index,
                )
            )
            cap_rps = sum(r.ok for r in results) / seconds
            capacities.append(cap_rps)
            print(
                f"{name} round {round_index + 1}/{scenario.rounds}: singleton capacity {cap_rps:.3f} req/s", flush=True
            )
            for load in points:
                rate = math.inf if load == SATURATION else load * cap_rps
                count = max(per_round, saturation) if load == SATURATION else per_round
                for label in scenario.load_servers:
                    concurrency = saturation if load == SATURATION else count
                    results, seconds = asyncio.run(
                        _requests(
                            urls[label],
                            spec,
                            rate=rate,
                            concurrency=concurrency,
                            requests=count,
                            seed=1000 * (round_index + 1),
                        )
                    )
                    done, total = raw.get((load, label), ([], 0.0))
                    raw[(load, label)] = (done + results, total + seconds)
        rows = []
        for load in points:
            for label in scenario.load_servers:
                results, seconds = raw[(load, label)]
                rate = math.inf if load == SATURATION else load * statistics.mean(capacities)
                summary = summarize_setting(
                    results,
                    concurrency=saturation if load == SATURATION else len(results),
                    request_rate=rate,
                    duration_s=seconds,
                )
                rows.append({"load": load, "server": label, **summary})
                print(_format_row(name, rows[-1]), flush=True)
        return {
            "scenario": name,
            "size": scenario.size,
            "steps": scenario.steps,
            "requests": per_round * scenario.rounds,
            "rounds": scenario.rounds,
            "singleton_capacity_rps": statistics.mean(capacities),
            "capacity_per_round": capacities,
            "saturation_concurrency": saturation,
            "rows": rows,
        }
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _load_label(load: Any) -> str:
    return "sat " if load == SATURATION else f"{load * 100:3.0f}%"


def _format_row(scenario: str, row: dict[str, Any]) -> str:
    lat = row["latency_ms"]
    return (
        f"{scenario:5} load={_load_label(row['load'])} {row['server']:10} ok={row['completed']:3d} "
        f"fail={row['failed']} thr={row['throughput_rps']:.3f} req/s mean={lat['mean'] or 0:.0f}ms "
        f"p50={lat['p50'] or 0:.0f}ms p99={lat['p99'] or 0:.0f}ms"
    )


def _find(report: dict[str, Any], load: Any, server: str) -> dict[str, Any] | None:
    return next((r for r in report["rows"] if r["load"] == load and r["server"] == server), None)


def targets(report: dict[str, Any]) -> list[str]:
    """The issue-10 targets of one scenario, each `met` / `NOT met` with its figures."""
    lines = []
    dyn, cont = _find(report, 0.7, "dynamic"), _find(report, 0.7, "continuous")
    if dyn and cont:
        ratio = cont["latency_ms"]["mean"] / dyn["latency_ms"]["mean"]
        lines.append(
            f"{report['scenario']}: 70% load mean continuous/dynamic = {ratio:.2f} (target <= 0.70): "
            f"{'met' if ratio <= 0.7 else 'NOT met'}"
        )
        p99c, p99d = cont["latency_ms"]["p99"], dyn["latency_ms"]["p99"]
        lines.append(
            f"{report['scenario']}: 70% load p99 continuous {p99c:.0f}ms vs dynamic {p99d:.0f}ms "
            f"(target <=): {'met' if p99c <= p99d else 'NOT met'}"
        )
    dyn, cont = _find(report, SATURATION, "dynamic"), _find(report, SATURATION, "continuous")
    if dyn and cont:
        tc, td = cont["throughput_rps"], dyn["throughput_rps"]
        lines.append(
            f"{report['scenario']}: saturation throughput continuous {tc:.3f} vs dynamic {td:.3f} req/s "
            f"(target >=): {'met' if tc >= td else 'NOT met'}"
        )
    return lines


def _plot(reports: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        for label in SERVERS:
            rows = [r for r in report["rows"] if r["server"] == label and r["load"] != SATURATION]
            if not rows:
                continue
            loads = [r["load"] * 100 for r in rows]
            ax.plot(loads, [r["latency_ms"]["mean"] for r in rows], "o-", color=COLORS[label], label=f"{label} mean")
            ax.plot(loads, [r["latency_ms"]["p99"] for r in rows], "s--", color=COLORS[label], label=f"{label} p99")
        ax.set(
            title=f"{report['scenario']} {report['size']}, {report['steps']} steps, {report['requests']} req/point",
            xlabel="load (% of singleton capacity)",
            ylabel="latency (ms)",
        )
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def run_simulation(cost_names: list[str], args: argparse.Namespace) -> list[str]:
    """The load points on each simulated cost curve (see the module docstring); returns the printed lines."""
    from diffuserve.tools.bench_report import percentile
    from diffuserve.tools.sim_executor import COST_MODELS, simulate_arrivals, singleton_capacity_rps

    lines: list[str] = []
    for name in cost_names:
        cost = COST_MODELS[name]
        capacity = singleton_capacity_rps(cost, args.steps)
        lines.append(
            f"sim-{name}: {cost.name}; {args.steps} steps; singleton capacity {capacity:.2f} req/s; "
            f"{args.sim_requests} requests per point"
        )
        print(lines[-1], flush=True)
        means: dict[tuple[float, str], tuple[float, float]] = {}
        for load in args.loads:
            for label in args.load_servers:
                latencies = simulate_arrivals(
                    label,
                    cost,
                    rate=load * capacity,
                    requests=args.sim_requests,
                    steps=args.steps,
                    seed=int(load * 1000),
                )
                mean, p99 = statistics.mean(latencies) * 1000, percentile(latencies, 99) * 1000
                means[(load, label)] = (mean, p99)
                lines.append(
                    f"sim-{name:3} load={_load_label(load)} {label:10} mean={mean:.0f}ms "
                    f"p50={percentile(latencies, 50) * 1000:.0f}ms p99={p99:.0f}ms"
                )
                print(lines[-1], flush=True)
        if (0.7, "dynamic") in means and (0.7, "continuous") in means:
            (md, pd), (mc, pc) = means[(0.7, "dynamic")], means[(0.7, "continuous")]
            lines.append(
                f"sim-{name}: 70% load mean continuous/dynamic = {mc / md:.2f} (target <= 0.70): "
                f"{'met' if mc / md <= 0.7 else 'NOT met'}; p99 continuous {pc:.0f}ms vs dynamic {pd:.0f}ms "
                f"(target <=): {'met' if pc <= pd else 'NOT met'}"
            )
            print(lines[-1], flush=True)
    return lines


def run_mixed(cost_names: list[str], args: argparse.Namespace) -> list[str]:
    """`--mixed`: size-grouped against token budget + DRR on the mixed and the one-shape workloads."""
    from diffuserve.tools.sim_executor import COST_MODELS
    from diffuserve.tools.sim_mixed import ABLATION, MIXED_SIZES, ONE_SHAPE, SCHEDULERS, compare, report

    lines: list[str] = []
    delay_ms = 0.0 if args.mixed_mode == "continuous" else 5.0
    # --mixed-fair-order: the fair order alone, both packing: fifo as the baseline (load relative to its saturation).
    budget = args.mixed_max_tokens
    pair = {"tokens (fifo)": ABLATION["tokens (fifo)"], "tokens+drr": SCHEDULERS["tokens+drr"]}
    fair = {k: replace(v, max_tokens=budget) for k, v in pair.items()} if args.mixed_fair_order else None
    baseline = "tokens (fifo)" if fair else "size-grouped"
    for name in cost_names:
        cost = COST_MODELS[name]
        lines.append(
            f"sim-{name}: {cost.name}; {args.steps} steps; {args.mixed_requests} requests per point; saturation: "
            f"{args.mixed_clients} closed-loop clients; load: 70% of {baseline} saturation; {args.mixed_mode}, "
            f"max size 8, {delay_ms:g} ms"
        )
        print(lines[-1], flush=True)
        for label, workload in (("mixed", MIXED_SIZES), ("one-shape", ONE_SHAPE))[: 1 if fair else 2]:
            mixed = label == "mixed"
            results = compare(
                cost,
                workload,
                requests=args.mixed_requests,
                clients=args.mixed_clients,
                steps=args.steps,
                mode=args.mixed_mode,
                delay_ms=delay_ms,
                schedulers=fair or (SCHEDULERS | ABLATION if args.mixed_ablation and mixed else SCHEDULERS),
                baseline=baseline,
            )
            block = report(f"sim-{name} {label}", results, targets=mixed and not fair, baseline=baseline)
            lines += block
            print("\n".join(block), flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=["tiny", "36m"], default=["tiny", "36m"])
    parser.add_argument("--steps", type=int, default=4, help="Denoising steps of every request.")
    parser.add_argument("--requests", type=int, default=30, help="tiny: requests per load point and server.")
    parser.add_argument("--loads", type=float, nargs="+", default=list(LOADS), help="tiny: loads (share of capacity).")
    parser.add_argument(
        "--load-servers",
        nargs="+",
        choices=list(SERVERS),
        default=list(SERVERS),
        help="tiny: servers measured at the load points.",
    )
    parser.add_argument(
        "--saturation-concurrency",
        type=int,
        default=8,
        help="tiny: clients of the closed-loop saturation point (= the servers' --batching-max-size).",
    )
    parser.add_argument("--rounds", type=int, default=4, help="tiny: rounds the requests of a point are spread over.")
    parser.add_argument("--requests-36m", type=int, default=6, help="36m: requests per load point and server.")
    parser.add_argument("--loads-36m", type=float, nargs="+", default=list(LOADS), help="36m: loads.")
    parser.add_argument(
        "--load-servers-36m",
        nargs="+",
        choices=list(SERVERS),
        default=list(SERVERS),
        help="36m: servers measured at the load points.",
    )
    parser.add_argument(
        "--saturation-concurrency-36m", type=int, default=8, help="36m: clients of the closed-loop saturation point."
    )
    parser.add_argument("--rounds-36m", type=int, default=2, help="36m: rounds.")
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="Write arrivals.txt, arrivals.json and arrivals.svg here."
    )
    parser.add_argument(
        "--plot-from",
        type=Path,
        default=None,
        help="Only redraw the plot of a saved arrivals.json (next to it, as arrivals.svg).",
    )
    parser.add_argument(
        "--simulate",
        nargs="+",
        choices=["gpu", "cpu"],
        default=None,
        help="No model: the real engine on a simulated accelerator with these step-cost curves.",
    )
    parser.add_argument("--sim-requests", type=int, default=200, help="--simulate: requests per load point.")
    parser.add_argument("--mixed", action="store_true", help="--simulate: the mixed-size comparison (issue 31).")
    parser.add_argument("--mixed-requests", type=int, default=240, help="--mixed: requests per point.")
    parser.add_argument("--mixed-clients", type=int, default=16, help="--mixed: closed-loop clients at saturation.")
    parser.add_argument("--mixed-mode", choices=["dynamic", "continuous"], default="dynamic", help="--mixed: mode.")
    parser.add_argument("--mixed-ablation", action="store_true", help="--mixed: also each half of the change alone.")
    parser.add_argument("--mixed-fair-order", action="store_true", help="--mixed: drr against fifo, both packing.")
    parser.add_argument("--mixed-max-tokens", type=int, default=8192, help="--mixed-fair-order: the token budget.")
    args = parser.parse_args(argv)
    if args.simulate:
        lines = (run_mixed if args.mixed else run_simulation)(args.simulate, args)
        if args.output_dir:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            (args.output_dir / "simulate.txt").write_text("\n".join(lines) + "\n")
        return 0
    if args.plot_from:
        _plot(json.loads(args.plot_from.read_text()), args.plot_from.with_suffix(".svg"))
        return 0
    scenarios = _scenarios(args)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-arrivals-") as tmp:
        reports = [run_scenario(name, scenarios[name], Path(tmp)) for name in args.scenarios]
    lines = [_format_row(r["scenario"], row) for r in reports for row in r["rows"]]
    lines += [f"{r['scenario']}: singleton capacity {r['singleton_capacity_rps']:.3f} req/s" for r in reports]
    lines += [line for r in reports for line in targets(r)]
    lines.append(
        f"wall time {time.monotonic() - started:.0f}s; command: bench_arrivals.py {' '.join(argv or sys.argv[1:])}"
    )
    print("\n".join(lines[sum(len(r["rows"]) for r in reports) :]))
    if args.output_dir:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "arrivals.txt").write_text("\n".join(lines) + "\n")
        (args.output_dir / "arrivals.json").write_text(json.dumps(reports, indent=2))
        _plot(reports, args.output_dir / "arrivals.svg")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
