"""Dynamic batching, side by side: direct diffusers batch 1 / batch 8 vs singleton and dynamic serving.

    .venv/bin/python benchmarks/bench_batching.py                     # both scenarios, ~5 minutes
    .venv/bin/python benchmarks/bench_batching.py --quick             # a smoke run, ~1.5 minutes
    .venv/bin/python benchmarks/bench_batching.py --scenarios tiny --requests 128 --output-json out.json

Two scenarios, each on a FLUX.1-style checkpoint built into a temp dir by
`diffuserve.models.tiny.build_tiny_checkpoint`:

- `tiny` (~72k-parameter transformer) at 64x64, 4 steps: the model is overhead-bound, so batching
  pays. Targets (issue 3): dynamic >= 2.5x singleton serving and >= 0.90x direct batch-8.
- `36m` (~36M-parameter transformer) at 256x256, 4 steps: the model saturates the CPU, so batching
  cannot pay; it must not hurt. Target: dynamic >= 0.97x singleton serving.

Four configurations per scenario, measured round by round with the order alternating every round so
that load from other processes on the machine hits them alike:

- `direct b1`: `diffusers.FluxPipeline` in this process, one prompt per call.
- `direct b8`: the same pipeline, 8 prompts and 8 generators per call.
- `serve singleton`: a real `diffuserve serve` subprocess (singleton serving), 8 closed-loop clients.
- `serve dynamic`: a second subprocess with `--batching-mode dynamic --batching-max-size 8
  --batching-delay-ms D`, the same 8 clients.
- with `--quantization METHOD` (fp8, int8, int8-dynamic; repeatable): one more dynamic server per method,
  `serve dynamic METHOD`, the same flags plus `--quantization METHOD` (the DiT's Linears quantized at load), so
  a quantized model's serving throughput stands beside the unquantized one's in the same rounds:

      .venv/bin/python benchmarks/bench_batching.py --scenarios 36m --quantization int8-dynamic --quantization int8

Throughput is images / wall time of each round; the table shows the median over rounds. Latency
percentiles (nearest rank) pool every timed request: for the direct runs, the time of the call that
produced the image; for serving, send-to-answer at the client. Each ratio is the median of the
per-round ratios (paired rounds cancel slow drift). The servers' own `timings` give the split of the
serving latency into queue wait, inference, encoding and the rest (HTTP, JSON, base64, client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from diffuserve.tools.bench import percentile

NUM_CLIENTS = 8
"""Concurrent closed-loop clients against each server (and the direct batch size)."""
DEFAULT_DELAY_MS = 10.0
"""Batching delay of the dynamic server; see README.md for why 10 ms."""
_PROMPTS = (
    "a red fox in fresh snow, golden hour",
    "a lighthouse on a cliff at night",
    "a bowl of ramen, studio lighting",
    "an old tram in a rainy city street",
    "a hummingbird over a purple flower",
    "a sailboat on a calm lake at dawn",
    "a robot reading a book in a library",
    "a desert canyon under a starry sky",
)


@dataclass(frozen=True)
class Scenario:
    """One checkpoint and request shape, with its targets."""

    name: str = "tiny"
    """Tiny-checkpoint preset (`tiny` or `36m`)."""
    size: int = 64
    """Image width and height in pixels."""
    steps: int = 4
    """Denoising steps."""
    num_requests: int = 64
    """Timed images per configuration per round."""
    num_rounds: int = 5
    """Timed rounds (one untimed warm-up round comes first)."""
    targets: tuple[tuple[str, str, float], ...] = ()
    """(numerator, denominator, minimum) throughput ratios the issue names."""


SCENARIOS = {
    "tiny": Scenario(
        "tiny", 64, 4, 64, 5,
        (("serve dynamic", "serve singleton", 2.5), ("serve dynamic", "direct b8", 0.90)),
    ),
    "36m": Scenario("36m", 256, 4, 16, 3, (("serve dynamic", "serve singleton", 0.97),)),
}  # fmt: skip
CONFIGS = ("direct b1", "direct b8", "serve singleton", "serve dynamic")


@dataclass
class Sample:
    """One timed image."""

    latency_ms: float = 0.0
    """Call time (direct) or client send-to-answer (serving)."""
    timings: dict[str, Any] = field(default_factory=dict)
    """The server's `timings` object (serving only)."""


@dataclass
class ConfigResult:
    """Everything measured for one configuration of one scenario."""

    throughput: list[float] = field(default_factory=list)
    """Images/s of each timed round."""
    samples: list[Sample] = field(default_factory=list)
    """Every timed image of every round."""

    def summary(self) -> dict[str, Any]:
        lat = [s.latency_ms for s in self.samples]
        out: dict[str, Any] = {
            "images_per_s_median": statistics.median(self.throughput),
            "images_per_s_rounds": [round(t, 3) for t in self.throughput],
            "latency_ms_p50": percentile(lat, 50),
            "latency_ms_p95": percentile(lat, 95),
            "num_images": len(lat),
        }
        timed = [s.timings for s in self.samples if s.timings]
        if timed:
            # Server-side split of the latency; `other` = client latency - server total (HTTP, JSON, base64).
            def med(key: str) -> float:
                return statistics.median(float(t.get(key) or 0.0) for t in timed)

            out["server_ms_median"] = {
                k: round(med(k), 2) for k in ("queue_wait_ms", "inference_ms", "encode_ms", "total_ms")
            }
            out["server_ms_median"]["other_ms"] = round(
                statistics.median(
                    s.latency_ms - float(s.timings.get("total_ms") or 0.0) for s in self.samples if s.timings
                ),
                2,
            )
            sizes = [int(t.get("batch_size") or 1) for t in timed]
            out["mean_batch_size_per_request"] = round(sum(sizes) / len(sizes), 2)
            # Requests per dispatch = harmonic view: a batch of k contributes k requests of size k.
            out["dispatches"] = round(sum(1 / s for s in sizes), 1)
        return out


# -- 1. servers -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A `diffuserve serve` subprocess on a free loopback port; logs go to a file."""

    def __init__(self, model_path: Path, extra: Sequence[str], log_path: Path, env: dict[str, str]):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "diffuserve.cli", "serve", "--model-path", str(model_path),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *extra,
        ]  # fmt: skip
        self.command = " ".join(cmd)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-num_chars:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def _serve_round(base_url: str, scenario: Scenario, num_requests: int, seed0: int) -> tuple[float, list[Sample]]:
    """`num_requests` requests from NUM_CLIENTS closed-loop clients; (wall seconds, samples)."""
    samples: list[Sample] = []
    indices = iter(range(num_requests))
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
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
                latency_ms = (time.perf_counter() - start) * 1000
                if not response.is_success:
                    raise RuntimeError(f"{base_url}: HTTP {response.status_code}: {payload}")
                samples.append(Sample(latency_ms, payload.get("timings") or {}))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(NUM_CLIENTS)))
        return time.perf_counter() - start, samples


# -- 2. direct pipeline -----------------------------------------------------------------------------


def _direct_runner(model_path: Path, scenario: Scenario) -> Callable[[int, int, int], tuple[float, list[Sample]]]:
    """A function (num_images, batch, seed0) -> (wall seconds, samples) over `diffusers.FluxPipeline`."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    guidance = 3.5 if pipe.transformer.config.guidance_embeds else 0.0

    def run(num_images: int, batch: int, seed0: int) -> tuple[float, list[Sample]]:
        samples: list[Sample] = []
        start = time.perf_counter()
        for first in range(0, num_images, batch):
            rows = range(first, min(first + batch, num_images))
            call_start = time.perf_counter()
            pipe(
                [_PROMPTS[i % len(_PROMPTS)] for i in rows],
                height=scenario.size,
                width=scenario.size,
                num_inference_steps=scenario.steps,
                guidance_scale=guidance,
                generator=[torch.Generator().manual_seed(seed0 + i) for i in rows],
                # The checkpoint's declared T5 length, as the served native pipeline uses.
                max_sequence_length=pipe.tokenizer_2.model_max_length,
            )
            call_ms = (time.perf_counter() - call_start) * 1000
            samples.extend(Sample(call_ms) for _ in rows)
        return time.perf_counter() - start, samples

    return run


# -- 3. one scenario --------------------------------------------------------------------------------


def run_scenario(
    scenario: Scenario,
    workdir: Path,
    delay_ms: float,
    threads: int,
    log: Callable[[str], None],
    quantizations: Sequence[str] = (),
) -> dict[str, Any]:
    from diffuserve.models.tiny import build_tiny_checkpoint

    model_path = build_tiny_checkpoint("flux", workdir / scenario.name, preset=scenario.name)
    dynamic = [
        "--batching-mode", "dynamic", "--batching-max-size", str(NUM_CLIENTS), "--batching-delay-ms", f"{delay_ms:g}",
    ]  # fmt: skip
    flags = {"serve singleton": [], "serve dynamic": dynamic}
    flags.update({f"serve dynamic {method}": [*dynamic, "--quantization", method] for method in quantizations})
    configs = (*CONFIGS, *(f"serve dynamic {method}" for method in quantizations))
    # torch reads OMP_NUM_THREADS at start-up: the servers get the intra-op threads of this process.
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    servers = {
        name: Server(model_path, extra, workdir / f"{scenario.name}-{'-'.join(name.split()[1:])}.log", env)
        for name, extra in flags.items()
    }
    try:
        direct = _direct_runner(model_path, scenario)  # loads while the servers start
        for server in servers.values():
            server.wait_healthy()

        def measure(config: str, num_images: int, seed0: int) -> tuple[float, list[Sample]]:
            if config == "direct b1":
                return direct(num_images, 1, seed0)
            if config == "direct b8":
                return direct(num_images, NUM_CLIENTS, seed0)
            return asyncio.run(_serve_round(servers[config].base_url, scenario, num_images, seed0))

        results = {config: ConfigResult() for config in configs}
        # Round 0 is an untimed warm-up (first calls at this shape, allocator, connection pools).
        for round_index in range(scenario.num_rounds + 1):
            order = configs if round_index % 2 == 0 else configs[::-1]
            num_images = NUM_CLIENTS if round_index == 0 else scenario.num_requests
            for config in order:
                wall_s, samples = measure(config, num_images, seed0=1000 * round_index)
                if round_index:
                    results[config].throughput.append(len(samples) / wall_s)
                    results[config].samples.extend(samples)
            if round_index:
                log(
                    f"  {scenario.name} round {round_index}/{scenario.num_rounds}: "
                    + ", ".join(f"{c} {results[c].throughput[-1]:.1f}" for c in configs)
                    + " img/s"
                )
    finally:
        for server in servers.values():
            server.stop()

    ratios = []
    targets = [*scenario.targets, *((f"serve dynamic {m}", "serve dynamic", 0.0) for m in quantizations)]
    for num, den, target in targets:
        per_round = [a / b for a, b in zip(results[num].throughput, results[den].throughput, strict=True)]
        ratios.append({
            "numerator": num, "denominator": den, "target_min": target,
            "ratio_median": statistics.median(per_round), "ratio_rounds": [round(r, 3) for r in per_round],
            "met": statistics.median(per_round) >= target,
        })  # fmt: skip
    return {
        "scenario": scenario.name,
        "size": f"{scenario.size}x{scenario.size}",
        "steps": scenario.steps,
        "requests_per_round": scenario.num_requests,
        "rounds": scenario.num_rounds,
        "server_commands": {name: s.command for name, s in servers.items()},
        "configs": {config: results[config].summary() for config in configs},
        "ratios": ratios,
    }


# -- 4. report --------------------------------------------------------------------------------------


def format_scenario(report: dict[str, Any]) -> str:
    lines = [
        f"== {report['scenario']}: {report['size']}, {report['steps']} steps, "
        f"{report['requests_per_round']} images x {report['rounds']} rounds per configuration",
        f"{'configuration':<27}{'img/s':>8}{'p50 ms':>9}{'p95 ms':>9}{'batch':>7}"
        f"{'queue':>8}{'infer':>8}{'encode':>8}{'other':>8}",
    ]
    for config, s in report["configs"].items():
        split = s.get("server_ms_median")
        extra = (
            f"{s['mean_batch_size_per_request']:>7.2f}{split['queue_wait_ms']:>8.1f}{split['inference_ms']:>8.1f}"
            f"{split['encode_ms']:>8.1f}{split['other_ms']:>8.1f}"
            if split
            else f"{'1' if config.endswith('b1') else str(NUM_CLIENTS):>7}"
        )
        lines.append(
            f"{config:<27}{s['images_per_s_median']:>8.2f}{s['latency_ms_p50']:>9.1f}{s['latency_ms_p95']:>9.1f}{extra}"
        )
    for r in report["ratios"]:
        verdict = "met" if r["met"] else "MISSED"
        target = f"target >= {r['target_min']:.2f}x: {verdict}" if r["target_min"] else "no target"
        lines.append(
            f"{r['numerator']} / {r['denominator']} = {r['ratio_median']:.2f}x ({target}; rounds {r['ratio_rounds']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="tiny,36m", help="comma-separated: tiny, 36m (%(default)s)")
    parser.add_argument("--requests", type=int, default=None, help="timed images per configuration per round")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per scenario")
    parser.add_argument("--delay-ms", type=float, default=DEFAULT_DELAY_MS, help="dynamic server's --batching-delay-ms")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of every side (this process and both servers); see README (%(default)s)",
    )
    parser.add_argument(
        "--quantization",
        action="append",
        default=[],
        choices=("fp8", "int8", "int8-dynamic"),
        help="also serve the model with --quantization METHOD (dynamic batching), side by side; repeatable",
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds: a smoke run")
    parser.add_argument("--output-json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        parser.error(f"--scenarios: unknown {unknown}; choose from {sorted(SCENARIOS)}")
    for flag, value in (("--requests", args.requests), ("--rounds", args.rounds)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    # SIGTERM -> SystemExit, so the `finally` blocks stop the server subprocesses.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    reports = []
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        for name in names:
            base = SCENARIOS[name]
            quick = {"num_requests": max(8, base.num_requests // 4), "num_rounds": 2} if args.quick else {}
            fields = {**base.__dict__, **quick}
            if args.requests is not None:
                fields["num_requests"] = args.requests
            if args.rounds is not None:
                fields["num_rounds"] = args.rounds
            scenario = Scenario(**fields)
            log(f"{name}: building the checkpoint and starting two servers ...")
            reports.append(run_scenario(scenario, Path(tmp), args.delay_ms, args.threads, log, args.quantization))

    header = (
        f"bench_batching: {NUM_CLIENTS} clients, dynamic = --batching-max-size {NUM_CLIENTS} "
        f"--batching-delay-ms {args.delay_ms:g}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs; {time.monotonic() - started:.0f}s\n"
        "batch = mean batch size seen by a request; queue/infer/encode = server timings (median ms); "
        "other = client latency - server total (HTTP, JSON, base64)"
    )
    print(header)
    for report in reports:
        print()
        print(format_scenario(report))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "num_clients": NUM_CLIENTS, "delay_ms": args.delay_ms, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "scenarios": reports,
        }  # fmt: skip
        args.output_json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\njson: {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
