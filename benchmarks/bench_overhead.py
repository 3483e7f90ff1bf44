"""Serving overhead, side by side in one run: a plain diffusers `FluxPipeline` loop vs diffuserve serving.

    .venv/bin/python benchmarks/bench_overhead.py                 # 32 images x 3 rounds per configuration
    .venv/bin/python benchmarks/bench_overhead.py --requests 16 --rounds 2 --output-json out.json
    .venv/bin/python benchmarks/bench_overhead.py --api-process both   # each server once per process layout

One tiny FLUX checkpoint (`build_tiny_checkpoint("flux", dir)`), 64x64, 4 steps, one torch thread on every side,
the checkpoint's declared T5 length on both sides (issue 24). Four configurations, measured round by round with
the order alternating every round (load from other processes hits them alike):

- `plain b1` / `plain b8`: `diffusers.FluxPipeline` in this process, 1 or 8 prompts per call.
- `singleton@1`: a `diffuserve serve` subprocess (singleton serving), 1 closed-loop client.
- `dynamic@8`: a second subprocess, `--batching-mode dynamic --batching-max-size 8 --batching-delay-ms 5`,
  8 closed-loop clients.

`--api-process separate` runs the servers with the engine core in its own process (`serve --api-process separate`);
`both` runs each serving configuration twice, once per layout (the split ones named `... split`), side by side.

Per serving configuration it reports img/s, the average batch a request ran in (the `timings.batch_size` of each
answer), and the serving CPU per image: the server process's CPU time outside pipeline calls
(`diffuserve_process_cpu_seconds_total - diffuserve_pipeline_cpu_seconds` from /metrics, `runtime/cpu_time.py`) over
the round, divided by its images. Cold start: spawning `diffuserve serve` on the embedded default model, alone,
to /health 200 (the second of two starts, so a first build of the model's cache is not counted), with the
server's own CPU time by then (about the wall time of a start on an idle host).
Targets (issue 24 items 5 and 6): dynamic@8 >= 1.0x plain b8 with a mean batch >= 6; singleton@1 >= 1.1x plain
b1; serving CPU per image <= 5 ms; cold start <= 8 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import _PROMPTS, Sample, Scenario, Server, _direct_runner, _free_port  # noqa: E402

PLAIN = ("plain b1", "plain b8")
TARGETS = (("dynamic@8", "plain b8", 1.0), ("singleton@1", "plain b1", 1.1))
LAYOUTS = {"same": ("same",), "separate": ("separate",), "both": ("same", "separate")}
"""--api-process -> the server process layouts measured."""


def serving_flags(api_process: str, delay_ms: float) -> dict[str, list[str]]:
    """Serving configuration name -> its `serve` flags (`... split`: the engine core in its own process)."""
    configs: dict[str, list[str]] = {}
    for layout in LAYOUTS[api_process]:
        suffix = " split" if layout == "separate" and api_process == "both" else ""
        dynamic = ["--batching-mode", "dynamic", "--batching-max-size", "8", "--batching-delay-ms", f"{delay_ms:g}"]
        configs[f"singleton@1{suffix}"] = ["--api-process", layout]
        configs[f"dynamic@8{suffix}"] = [*dynamic, "--api-process", layout]
    return configs


def clients_of(config: str) -> int:
    """Closed-loop clients of a serving configuration."""
    return 1 if config.startswith("singleton") else 8


CPU_TARGET_MS = 5.0
BATCH_TARGET = 6.0
"""The average batch a request of dynamic@8 runs in (issue 24 item 5)."""
COLD_START_TARGET_S = 8.0


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def serving_cpu_s(base_url: str) -> float:
    """The server's CPU seconds outside pipeline calls so far (NaN when the server does not export them)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text
    return _metric(text, "diffuserve_process_cpu_seconds_total") - _metric(text, "diffuserve_pipeline_cpu_seconds")


async def serve_round(
    base_url: str, scenario: Scenario, clients: int, num_requests: int, seed0: int
) -> tuple[float, list[Sample]]:
    """`num_requests` requests from `clients` closed-loop clients; (wall seconds, samples)."""
    samples: list[Sample] = []
    indices = iter(range(num_requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, trust_env=False) as client:

        async def worker() -> None:
            for i in indices:  # shared iterator: the next free client takes the next request
                body = {
                    "prompt": _PROMPTS[i % len(_PROMPTS)],
                    "size": f"{scenario.size}x{scenario.size}",
                    "num_inference_steps": scenario.steps,
                    "seed": seed0 + i,
                    "response_format": "b64_json",
                }
                start = time.perf_counter()
                response = await client.post("/v1/images/generations", json=body)
                payload = response.json()
                if not response.is_success:
                    raise RuntimeError(f"{base_url}: HTTP {response.status_code}: {payload}")
                samples.append(Sample((time.perf_counter() - start) * 1000, payload.get("timings") or {}))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - start, samples


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux `/proc`; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cold_start_s(env: dict[str, str], timeout_s: float = 300.0, api_process: str = "same") -> tuple[float, float]:
    """Seconds from spawning `diffuserve serve` on the embedded default model (no --model-path) to /health 200, and
    the server's own CPU seconds by then (the front end's, under --api-process separate): a start is one busy
    thread, so on a busy host its CPU time says what an idle one would take."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "diffuserve.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--api-process",
        api_process,
    ]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the embedded-model server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                    return time.monotonic() - started, process_cpu_s(proc.pid)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the embedded-model server was not healthy after {timeout_s:.0f}s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(
    workdir: Path, num_requests: int, num_rounds: int, delay_ms: float, log: Any, api_process: str = "same"
) -> dict[str, Any]:
    from diffuserve.models.tiny import build_tiny_checkpoint

    scenario = Scenario("tiny", 64, 4, num_requests, num_rounds)
    model_path = build_tiny_checkpoint("flux", workdir / "tiny")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    layout = LAYOUTS[api_process][-1]  # both: the split layout's
    cold_start_s(env, api_process=layout)  # the first start may build the embedded model's cache; the second counts
    cold_s, cold_cpu_s = cold_start_s(env, api_process=layout)
    flags = serving_flags(api_process, delay_ms)
    servers = {
        name: Server(model_path, extra, workdir / f"{name.replace('@', '-').replace(' ', '-')}.log", env)
        for name, extra in flags.items()
    }
    configs = (*PLAIN, *flags)
    throughput: dict[str, list[float]] = {c: [] for c in configs}
    batches: dict[str, list[int]] = {c: [] for c in flags}
    cpu_ms: dict[str, list[float]] = {c: [] for c in flags}
    try:
        for server in servers.values():
            server.wait_healthy()
        direct = _direct_runner(model_path, scenario)
        for round_index in range(num_rounds + 1):  # round 0: untimed warm-up
            order = configs if round_index % 2 == 0 else configs[::-1]
            count = 8 if round_index == 0 else num_requests
            for config in order:
                if config.startswith("plain"):
                    wall, samples = direct(count, 1 if config == "plain b1" else 8, 1000 * round_index)
                else:
                    url = servers[config].base_url
                    cpu_before = serving_cpu_s(url)
                    wall, samples = asyncio.run(
                        serve_round(url, scenario, clients_of(config), count, 1000 * round_index)
                    )
                    cpu_after = serving_cpu_s(url)
                    if round_index:
                        batches[config] += [int(s.timings.get("batch_size") or 1) for s in samples]
                        cpu_ms[config].append((cpu_after - cpu_before) * 1000 / len(samples))
                if round_index:
                    throughput[config].append(len(samples) / wall)
            if round_index:
                log(
                    f"round {round_index}/{num_rounds}: "
                    + ", ".join(f"{c} {throughput[c][-1]:.1f}" for c in configs)
                    + " img/s"
                )
    finally:
        for server in servers.values():
            server.stop()
    ratios = {
        f"{a}{suffix} / {b}": {
            "median": statistics.median(x / y for x, y in zip(throughput[a + suffix], throughput[b], strict=True)),
            "target": t,
        }
        for suffix in ("", " split")
        for a, b, t in TARGETS
        if a + suffix in flags
    }
    return {
        "size": "64x64",
        "steps": 4,
        "requests_per_round": num_requests,
        "rounds": num_rounds,
        "delay_ms": delay_ms,
        "api_process": api_process,
        "images_per_s": {c: statistics.median(v) for c, v in throughput.items()},
        "ratios": ratios,
        "mean_batch": {c: sum(v) / len(v) for c, v in batches.items()},
        "serving_cpu_ms_per_image": {c: statistics.median(v) for c, v in cpu_ms.items()},
        "cold_start_s": cold_s,
        "cold_start_cpu_s": cold_cpu_s,
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"bench_overhead: tiny FLUX {r['size']}, {r['steps']} steps, {r['requests_per_round']} images x "
        f"{r['rounds']} rounds, dynamic delay {r['delay_ms']:g} ms, 1 torch thread, {os.cpu_count()} CPUs, "
        f"--api-process {r.get('api_process', 'same')}"
    ]
    for config, ips in r["images_per_s"].items():
        extra = ""
        if config in r["mean_batch"]:
            extra = (
                f"   mean batch {r['mean_batch'][config]:.2f}   serving CPU "
                f"{r['serving_cpu_ms_per_image'][config]:.1f} ms/img"
            )
        lines.append(f"  {config:<12}{ips:>8.1f} img/s{extra}")
    for name, ratio in r["ratios"].items():
        verdict = "met" if ratio["median"] >= ratio["target"] else "MISSED"
        lines.append(f"  {name} = {ratio['median']:.2f}x (target >= {ratio['target']:.1f}x: {verdict})")
    batch = r["mean_batch"]["dynamic@8"]
    verdict = "met" if batch >= BATCH_TARGET else "MISSED"
    lines.append(f"  dynamic@8 mean batch >= {BATCH_TARGET:g}: {verdict} ({batch:.2f})")
    worst = max(r["serving_cpu_ms_per_image"].values())
    lines.append(
        f"  serving CPU per image <= {CPU_TARGET_MS:g} ms: {'met' if worst <= CPU_TARGET_MS else 'MISSED'}"
        f" (worst {worst:.1f} ms)"
    )
    lines.append(
        f"  cold start to /health 200: {r['cold_start_s']:.1f} s (target <= {COLD_START_TARGET_S:g} s: "
        f"{'met' if r['cold_start_s'] <= COLD_START_TARGET_S else 'MISSED'}; embedded model, alone, warm cache; "
        f"the server's own CPU time {r.get('cold_start_cpu_s', float('nan')):.1f} s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="timed images per configuration per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="dynamic server's --batching-delay-ms")
    parser.add_argument(
        "--api-process",
        choices=tuple(LAYOUTS),
        default="same",
        help="the servers' process layout (serve --api-process); both: each serving configuration in each layout",
    )
    parser.add_argument("--output-json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` stops the servers
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        report = run(
            Path(tmp),
            args.requests,
            args.rounds,
            args.delay_ms,
            lambda text: print(text, file=sys.stderr, flush=True),
            api_process=args.api_process,
        )
    print(format_report(report))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
