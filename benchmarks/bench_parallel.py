"""Parallel modes side by side: 1 rank vs N ranks of a real `diffuserve serve --num-gpus N`, same requests.

    .venv/bin/python benchmarks/bench_parallel.py                                   # every mode, CPU (gloo)
    .venv/bin/python benchmarks/bench_parallel.py --modes cfg2,dp2 --requests 3 --concurrency 2
    .venv/bin/python benchmarks/bench_parallel.py --device cuda --size 1024x1024 --steps 20  # GPUs (NCCL)

The servers run the FLUX.1-style checkpoint with the ~36M-parameter transformer (`build_tiny_checkpoint("flux",
preset="36m")`, written once under the cache folder; `--model-path` takes any other checkpoint). A single-rank
server stays up the whole run; each mode's server is started in turn, and `--requests` rounds alternate between
the two (who goes first alternates too), so both sides of every ratio saw the same machine load. Requests go
through the official `openai` client with true CFG on (`true_cfg_scale` + `negative_prompt`: CFG parallel has
two branches to split, and every mode does the same work); each round is `--concurrency` requests at once
(2+ shows what `--dp-size` adds), first at `--steps` steps, then at 1 step.

Per mode: latency mean / p50, the paired single-rank mean and the N/1 ratios, throughput of the bursts, and
the per-call overhead of sending a batch to the ranks, from the server's /metrics histograms over the timed
requests: `deliver` (a call message reaching the slowest other rank of replica 0) and `straggle` (rank 0 waiting
for the others after its own part). `1-step +ms` is the 1-step latency on N ranks minus the paired one on 1 rank:
a cruder estimate that also holds the one step's collectives (and the only one for data-parallel replicas of
one rank, which have no other rank to deliver to). `procs` counts the server's process and its
descendants while it serves (the ranks, on one host) and the plan column is /server_info's deployment plan:
together they show that a mode really ran on N ranks. A mode the server refuses at start-up is printed with
its error and skipped. On a 2-core CPU host the figures check the plumbing (ranks share the cores, so no
speed-up is possible); speed shows on GPUs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

MODES: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "cfg2": (2, ["--enable-cfg-parallel", "true"]),
    "ulysses2": (2, ["--ulysses-degree", "2"]),
    "ring2": (2, ["--ring-degree", "2"]),
    "tp2": (2, ["--tp-size", "2"]),
    "fsdp2": (2, ["--use-fsdp-inference", "true"]),
    "dp2": (2, ["--dp-size", "2"]),
    "cfg2xulysses2": (4, ["--enable-cfg-parallel", "true", "--ulysses-degree", "2"]),
}
"""mode -> (ranks = --num-gpus, the serve flags that select it)."""
BASELINE = "single"
DELIVERY = "diffuserve_rank_call_delivery_seconds"
"""The server's histogram of the time a pipeline call takes to reach the slowest other rank of replica 0."""
STRAGGLE = "diffuserve_rank_call_straggle_seconds"
"""... and of the time rank 0 waits for the other ranks to finish after its own part."""
CFG = {"true_cfg_scale": 4.0, "negative_prompt": "blurry, low quality"}


@dataclass
class Samples:
    """One server's timed requests (client-side wall ms) in one pairing."""

    full_ms: list[float] = field(default_factory=list)
    one_step_ms: list[float] = field(default_factory=list)
    burst_rps: list[float] = field(default_factory=list)


@dataclass
class ModeResult:
    mode: str
    ranks: int
    flags: list[str]
    error: str | None = None
    samples: Samples = field(default_factory=Samples)
    baseline: Samples = field(default_factory=Samples)
    """The single-rank server's requests interleaved with this mode's (same moments, same machine load)."""
    delivery_ms: float | None = None
    """Mean per-call delivery to the other ranks over the timed requests (the server's histogram)."""
    straggle_ms: float | None = None
    """Mean per-call wait for the other ranks after rank 0's own part (the server's histogram)."""
    startup_s: float = 0.0
    plan: str = ""
    """What the server says it runs (/server_info's deployment plan)."""
    processes: int | None = None
    """The server's process and its descendants (resource trackers left out) while it served: the ranks."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint(cache: Path) -> Path:
    """The 36M FLUX.1-style checkpoint, built once into `cache` (atomically, so a killed build is redone)."""
    from diffuserve.models.tiny import build_tiny_checkpoint

    target = cache / "flux-36m"
    if (target / "model_index.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="flux-36m-", dir=cache))
    build_tiny_checkpoint("flux", tmp, preset="36m")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _start(cmd: list[str], url: str, log: Path, timeout_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=os.environ.copy())
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(_last_error(log))
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    _stop(proc)
    raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {_last_error(log)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no output)"])[-1][:300]


def _generate(client: openai.OpenAI, model: str, size: str, steps: int, seed: int) -> float:
    started = time.perf_counter()
    result = client.images.generate(
        model=model,
        prompt=f"a red fox in the snow, photo {seed}",
        size=size,
        n=1,
        response_format="b64_json",
        extra_body={"num_inference_steps": steps, "seed": seed, **CFG},
    )
    elapsed = (time.perf_counter() - started) * 1000
    assert result.data and result.data[0].b64_json, "the server answered without an image"
    return elapsed


def _histograms(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of every histogram on a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type == "histogram":
            values = {s.name: s.value for s in family.samples}
            out[family.name] = (values.get(f"{family.name}_sum", 0.0), values.get(f"{family.name}_count", 0.0))
    return out


def _mean_ms(before: dict, after: dict, name: str) -> float | None:
    """Mean of the observations between two scrapes (the timed requests only), in ms; None without any."""
    (s0, c0), (s1, c1) = before.get(name, (0.0, 0.0)), after.get(name, (0.0, 0.0))
    return (s1 - s0) / (c1 - c0) * 1000 if c1 > c0 else None


def _process_tree_size(pid: int) -> int | None:
    """`pid` and its live descendants from /proc (Linux), without multiprocessing's resource trackers."""
    children: dict[int, list[int]] = {}
    try:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if b"resource_tracker" not in cmdline:
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    except OSError:
        return None
    seen, todo = 0, [pid]
    while todo:
        seen += 1
        todo += children.get(todo.pop(), [])
    return seen


def _plan_summary(info: dict) -> str:
    plan = info.get("deployment_plan") or {}
    keys = (
        ("num_gpus", "gpus"),
        ("cfg_parallel", "cfg"),
        ("ulysses_degree", "ulysses"),
        ("ring_degree", "ring"),
        ("tp_size", "tp"),
        ("fsdp", "fsdp"),
        ("dp_size", "dp"),
    )
    shown = [
        f"{short}={plan[k]}" for k, short in keys if plan.get(k) is True or (type(plan.get(k)) is int and plan[k] > 1)
    ]
    replicas = [",".join(str(r) for r in rep.get("ranks", ())) for rep in info.get("replicas") or []]
    if replicas:  # the ranks each replica really runs on
        shown.append("replicas " + " | ".join(f"[{r}]" for r in replicas))
    return " ".join(shown) or "1 rank"


@dataclass
class Server:
    """One `diffuserve serve` process and an `openai` client for it."""

    mode: str
    proc: subprocess.Popen
    url: str
    client: openai.OpenAI
    model: str

    @classmethod
    def start(cls, mode: str, args: argparse.Namespace, workdir: Path, result: ModeResult) -> Server:
        ranks, flags = MODES[mode]
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(args.model_path),
            "--port",
            str(port),
            "--device",
            args.device,
            "--num-gpus",
            str(ranks),
            *flags,
            "--max-queue-size",
            "0",
            "--output-dir",
            str(workdir / f"out-{mode}"),
        ]
        if args.threads:
            cmd += ["--num-threads", str(args.threads)]
        print(f"[{mode}] {' '.join(cmd[3:])}", flush=True)
        started = time.monotonic()
        proc = _start(cmd, url, workdir / f"{mode}.log", args.startup_timeout)
        result.startup_s = time.monotonic() - started
        try:
            client = openai.OpenAI(
                base_url=f"{url}/v1",
                api_key="unused",
                max_retries=0,
                http_client=httpx.Client(trust_env=False, timeout=args.request_timeout),
            )
            server = cls(mode, proc, url, client, client.models.list().data[0].id)
            result.processes = _process_tree_size(proc.pid)
            result.plan = _plan_summary(httpx.get(f"{url}/server_info", timeout=10, trust_env=False).json())
            server.burst(args, True, seed=0, into=Samples())  # warm: first-request costs stay out of the figures
        except BaseException:
            _stop(proc)
            raise
        return server

    def burst(self, args: argparse.Namespace, one_step: bool, seed: int, into: Samples) -> None:
        """`--concurrency` requests at once; their latencies (and a full burst's throughput) go `into`."""
        steps = 1 if one_step else args.steps
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = [
                pool.submit(_generate, self.client, self.model, args.size, steps, seed + i)
                for i in range(args.concurrency)
            ]
            for future in futures:
                (into.one_step_ms if one_step else into.full_ms).append(future.result())
        if not one_step:
            into.burst_rps.append(args.concurrency / (time.perf_counter() - t0))

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10, trust_env=False).text

    def stop(self) -> None:
        _stop(self.proc)


def run_pair(mode: str, base: Server | None, args: argparse.Namespace, workdir: Path) -> ModeResult:
    """Start `mode`'s server and alternate its requests with the single-rank server's, round by round."""
    ranks, flags = MODES[mode]
    result = ModeResult(mode, ranks, flags)
    try:
        server = Server.start(mode, args, workdir, result)
    except (RuntimeError, TimeoutError, openai.OpenAIError, httpx.HTTPError) as exc:
        result.error = str(exc)[:300]
        print(f"[{mode}] refused / failed to start: {result.error}", flush=True)
        return result
    try:
        before = _histograms(server.metrics())
        for one_step in (False, True):
            for r in range(args.requests):
                pair = [(server, result.samples)] + ([(base, result.baseline)] if base is not None else [])
                for srv, into in pair if r % 2 == 0 else pair[::-1]:  # alternate who goes first
                    srv.burst(args, one_step, seed=1 + 100 * r, into=into)
        after = _histograms(server.metrics())
        result.delivery_ms = _mean_ms(before, after, DELIVERY)
        result.straggle_ms = _mean_ms(before, after, STRAGGLE)
    except (openai.OpenAIError, httpx.HTTPError, AssertionError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        print(f"[{mode}] request failed: {result.error}", flush=True)
    finally:
        server.stop()
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(results: list[ModeResult], args: argparse.Namespace) -> str:
    lines = [
        f"bench_parallel: {args.size}, {args.steps} steps, true CFG on, {args.requests} rounds per mode of "
        f"{args.concurrency} request(s), device {args.device}, model {args.model_label}",
        "N/1: latency over the single-rank server's, measured interleaved with it (same load). Per-call overhead "
        "of the ranks: deliver = a call reaching the slowest other rank, straggle = rank 0 waiting for the others "
        "after its part (the server's histograms, replica 0); 1-step +ms = 1-step latency minus the paired "
        "1-rank one (an estimate that also holds that step's collectives)",
        f"{'mode':14} {'ranks':>5} {'mean ms':>8} {'p50 ms':>8} {'1-rank':>7} {'N/1 mean':>8} {'N/1 p50':>7} "
        f"{'req/s':>6} {'1-step ms':>9} {'1-step +ms':>10} {'deliver ms':>10} {'straggle ms':>11} {'start s':>7} "
        f"{'procs':>5}  plan and replicas (/server_info)",
    ]
    for r in results:
        if r.error:
            lines.append(f"{r.mode:14} {r.ranks:5d}  not run: {r.error}")
            continue
        own = r.samples
        base = r.baseline if r.baseline.full_ms else own if r.mode == BASELINE else None
        mean, p50, one = statistics.mean(own.full_ms), statistics.median(own.full_ms), statistics.mean(own.one_step_ms)
        base_mean = ratio_mean = ratio_p50 = extra = "-"
        if base is not None:
            base_mean = f"{statistics.mean(base.full_ms):.0f}"
            ratio_mean = f"{mean / statistics.mean(base.full_ms):.2f}"
            ratio_p50 = f"{p50 / statistics.median(base.full_ms):.2f}"
        if r.baseline.one_step_ms:
            extra = f"{one - statistics.mean(r.baseline.one_step_ms):.0f}"
        lines.append(
            f"{r.mode:14} {r.ranks:5d} {mean:8.0f} {p50:8.0f} {base_mean:>7} {ratio_mean:>8} {ratio_p50:>7} "
            f"{statistics.mean(own.burst_rps):6.2f} {one:9.0f} {extra:>10} {_ms(r.delivery_ms):>10} "
            f"{_ms(r.straggle_ms):>11} {r.startup_s:7.0f} {r.processes or '?':>5}  {r.plan}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated modes ({', '.join(MODES)}); {BASELINE} always runs first",
    )
    parser.add_argument(
        "--requests", type=int, default=4, help="rounds per mode, at --steps and again at 1 step (each side)"
    )
    parser.add_argument("--size", default="256x256", help="image size WxH")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps of the timed requests")
    parser.add_argument("--device", default="cpu", help="serve --device: cpu (gloo ranks) or cuda (NCCL)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (2+ shows --dp-size)")
    parser.add_argument(
        "--threads", type=int, default=None, help="serve --num-threads per rank (None: the server's choice)"
    )
    parser.add_argument(
        "--model-path", type=Path, default=None, help="checkpoint folder (None: the 36M FLUX.1-style one)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the 36M checkpoint is built once (None: $DIFFUSERVE_CACHE/bench)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to turn healthy")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+x\d+", args.size):
        parser.error(f"--size {args.size!r} is not WxH (e.g. 256x256)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    modes = [BASELINE, *[m for m in modes if m != BASELINE]]
    if args.model_path is None:
        from diffuserve.paths import default_cache_dir

        args.model_path = checkpoint(args.cache_dir or default_cache_dir() / "bench")
        args.model_label = "FLUX.1-style, 36M-parameter transformer"
    else:
        args.model_label = str(args.model_path)
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        single = ModeResult(BASELINE, *MODES[BASELINE])
        try:
            base: Server | None = Server.start(BASELINE, args, Path(tmp), single)
        except (RuntimeError, TimeoutError, openai.OpenAIError, httpx.HTTPError) as exc:
            single.error, base = str(exc)[:300], None
        results = [single]
        try:
            for mode in modes[1:]:
                results.append(run_pair(mode, base, args, Path(tmp)))
            if base is not None and len(modes) == 1:  # only the baseline was asked for
                for one_step in (False, True):
                    for r in range(args.requests):
                        base.burst(args, one_step, seed=1 + 100 * r, into=single.samples)
        finally:
            if base is not None:
                base.stop()
        for r in results[1:]:  # the baseline row: all its requests, over every pairing
            for name in ("full_ms", "one_step_ms", "burst_rps"):
                getattr(single.samples, name).extend(getattr(r.baseline, name))
        if single.error is None and not single.samples.full_ms:
            single.error = "no paired mode ran"
    table = _table(results, args)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
