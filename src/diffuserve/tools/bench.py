"""`diffuserve bench`: drive a running server over HTTP and report throughput and latency.

One run sweeps a list of concurrencies. In each setting, `--num-requests` requests are sent either
closed-loop (`--request-rate inf`: each of `concurrency` workers sends its next request as soon as
its previous one is answered) or open-loop (Poisson arrivals at `--request-rate` req/s, at most
`concurrency` in flight). Latency is timed from the moment a request is sent to its answer, so a
Poisson arrival that waits for a free slot does not count that client-side wait as server latency.

The summaries are pure functions (`percentile`, `summarize`, `summarize_setting`) so the figures
in the table, the JSON and the plot come from one place and are tested on their own. Saved runs
can be overlaid with `--compare A.json B.json --plot out.png` (e.g. singleton vs dynamic serving).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffuserve.tools.bench_report import (
    RequestResult,
    format_table,
    load_run,
    percentile,
    plot_results,
    plot_runs,
    poisson_arrivals,
    summarize,
    summarize_setting,
)

if TYPE_CHECKING:  # httpx and tqdm load when a benchmark runs, not when the CLI parser is built
    import httpx

__all__ = [
    "add_bench_arguments",
    "run_bench",
    "percentile",
    "summarize",
    "summarize_setting",
    "poisson_arrivals",
    "plot_runs",
    "format_table",
    "RequestResult",
]

DEFAULT_BASE_URL = "http://127.0.0.1:30010"
#: How many distinct error messages a setting keeps for the report.
_TERMINAL_VIDEO_STATUSES = ("completed", "failed", "cancelled", "canceled", "expired")


# -- 1. flags -------------------------------------------------------------------------------------


def parse_concurrency(text: str) -> list[int]:
    """`"1,4,8"` -> `[1, 4, 8]`; argparse turns the ValueError into a message naming the flag."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers such as 1,4,8, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every concurrency must be >= 1, got {text!r}")
    return values


def parse_rate(text: str) -> float:
    """Requests per second: a positive number, or `inf` for the closed loop."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'inf', got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be > 0 (or 'inf'), got {text!r}")
    return rate


def parse_size(text: str) -> str:
    """Check `WxH` (e.g. `512x512`) and return it normalised."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 512x512, got {text!r}")
    return f"{int(parts[0])}x{int(parts[1])}"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `diffuserve bench` flags to `parser`."""
    group = parser.add_argument_group("target")
    group.add_argument("--base-url", default=DEFAULT_BASE_URL, help="Server to drive.")
    group.add_argument("--endpoint", choices=("images", "videos"), default="images", help="API to drive.")
    group.add_argument("--model", default=None, help="Model name to send; omitted by default.")
    group.add_argument("--api-key", default=None, help="Bearer token (default: $DIFFUSERVE_API_KEY).")
    group.add_argument("--timeout-s", type=float, default=600.0, help="Time limit of one request (s).")

    group = parser.add_argument_group("load")
    group.add_argument("--num-requests", type=int, default=32, help="Requests per setting.")
    group.add_argument("--concurrency", type=parse_concurrency, default=[1], help="Max in flight; 1,4,8 sweeps.")
    group.add_argument("--request-rate", type=parse_rate, default=math.inf, help="Poisson req/s; inf = closed loop.")
    group.add_argument("--warmup-requests", type=int, default=1, help="Untimed requests before the sweep.")

    group = parser.add_argument_group("request")
    group.add_argument("--prompt", default=BenchRequestSpec.prompt, help="Prompt of every request.")
    group.add_argument("--size", type=parse_size, default=None, help="WxH (server default if omitted).")
    group.add_argument("--steps", type=int, default=None, help="num_inference_steps (server default if omitted).")
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Base seed: request i of the k-th concurrency setting uses seed + k*num_requests + i, and the warm-up "
        "the seeds after every setting's, so no two requests of a run repeat one (a server's exact-result cache "
        "would answer the repeat without running the model).",
    )
    group.add_argument("--n", type=int, default=1, help="Images per request (images endpoint).")
    group.add_argument("--num-frames", type=int, default=None, help="Frames per video (videos endpoint).")

    group = parser.add_argument_group("report")
    group.add_argument("--label", default=None, help="Name of this run in the JSON and plot.")
    group.add_argument("--output-json", type=Path, default=None, help="Write the results here.")
    group.add_argument("--plot", type=Path, default=None, help="PNG: throughput and latency vs concurrency.")
    group.add_argument("--compare", type=Path, nargs="+", default=None, help="Overlay saved JSON runs (needs --plot).")
    group.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    group.add_argument(
        "--allow-failures",
        action="store_true",
        help="Exit 0 even when requests failed (by default any failed request of the sweep exits 1).",
    )


# -- 3. traffic -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequestSpec:
    """What every request of a run carries (seed aside)."""

    endpoint: str = "images"
    """`images` (POST /v1/images/generations) or `videos` (async jobs under /v1/videos)."""
    prompt: str = "a red circle on a white background"  # one the embedded demo model draws (docs/demo-model.md)
    """Prompt of every request."""
    model: str | None = None
    """Model name to send; the server's default when None."""
    size: str | None = None
    """`WxH`; the server's default when None."""
    steps: int | None = None
    """num_inference_steps; the server's default when None."""
    n: int = 1
    """Images per request (images endpoint)."""
    num_frames: int | None = None
    """Frames per video (videos endpoint); the server's default when None."""
    timeout_s: float = 600.0
    """Limit for one request (videos: from create to a terminal status)."""
    poll_interval_s: float = 0.5
    """Longest pause between two status polls of a video job."""

    def body(self, seed: int) -> dict[str, Any]:
        """The JSON body of one request."""
        body: dict[str, Any] = {"prompt": self.prompt, "seed": seed}
        optional = {"model": self.model, "size": self.size, "num_inference_steps": self.steps}
        if self.endpoint == "images":
            body.update(n=self.n, response_format="b64_json")
        else:
            optional["num_frames"] = self.num_frames
        body.update({k: v for k, v in optional.items() if v is not None})
        return body


def _error_message(response: httpx.Response) -> str:
    """`HTTP 500: <message>` from the OpenAI error envelope, or the start of the body."""
    try:
        message = response.json()["error"]["message"]
    except Exception:  # not JSON, or not the envelope: show what came back
        message = response.text[:200] or response.reason_phrase
    return f"HTTP {response.status_code}: {message}"


def _queue_wait(payload: dict[str, Any]) -> float | None:
    timings = payload.get("timings")
    value = timings.get("queue_wait_ms") if isinstance(timings, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


async def _send_image(client: httpx.AsyncClient, spec: BenchRequestSpec, seed: int) -> RequestResult:
    start = time.perf_counter()
    response = await client.post("/v1/images/generations", json=spec.body(seed))
    payload = response.json() if response.is_success else None
    latency_ms = (time.perf_counter() - start) * 1000
    if payload is None:
        return RequestResult(latency_ms=latency_ms, error=_error_message(response))
    data = payload.get("data")
    num_images = len(data) if isinstance(data, list) else spec.n
    return RequestResult(True, latency_ms, num_images, _queue_wait(payload))


async def _send_video(client: httpx.AsyncClient, spec: BenchRequestSpec, seed: int) -> RequestResult:
    start = time.perf_counter()
    response = await client.post("/v1/videos", json=spec.body(seed))
    if not response.is_success:
        return RequestResult(latency_ms=(time.perf_counter() - start) * 1000, error=_error_message(response))
    job, pause = response.json(), 0.02
    while str(job.get("status")) not in _TERMINAL_VIDEO_STATUSES:
        if time.perf_counter() - start > spec.timeout_s:
            return RequestResult(error=f"timed out after {spec.timeout_s:g}s (status {job.get('status')!r})")
        # Short polls first so fast jobs are timed closely, then back off to spare the server.
        await asyncio.sleep(pause)
        pause = min(pause * 2, spec.poll_interval_s)
        response = await client.get(f"/v1/videos/{job['id']}")
        if not response.is_success:
            return RequestResult(error=_error_message(response))
        job = response.json()
    latency_ms = (time.perf_counter() - start) * 1000
    if job["status"] != "completed":
        error = job.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return RequestResult(latency_ms=latency_ms, error=f"video {job['status']}: {message or 'no detail'}")
    return RequestResult(True, latency_ms, 1, _queue_wait(job))


async def _send(client: httpx.AsyncClient, spec: BenchRequestSpec, seed: int) -> RequestResult:
    """One request; never raises (a transport or protocol problem becomes a failed result)."""
    import httpx

    send = _send_image if spec.endpoint == "images" else _send_video
    try:
        return await send(client, spec, seed)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}".rstrip(": "))


async def _drive(
    send: Callable[[int], Awaitable[RequestResult]],
    num_requests: int,
    concurrency: int,
    arrivals: Sequence[float] | None,
    on_done: Callable[[RequestResult], None],
) -> list[RequestResult]:
    """Send requests 0..num_requests-1 with at most `concurrency` in flight; results in index order.

    `arrivals` are Poisson send times (s from start); None runs the closed loop.
    """
    results: list[RequestResult] = [RequestResult() for _ in range(num_requests)]

    async def run_one(index: int) -> None:
        results[index] = await send(index)
        on_done(results[index])

    if arrivals is None:
        # Closed loop: each worker takes the next index as soon as its previous request is answered.
        indices = iter(range(num_requests))

        async def worker() -> None:
            for index in indices:  # shared iterator; safe because the loop is single-threaded
                await run_one(index)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
        return results

    # Open loop: wait for each arrival time, then for a free slot.
    slots, tasks = asyncio.Semaphore(concurrency), []
    loop, begin = asyncio.get_running_loop(), asyncio.get_running_loop().time()

    async def run_slotted(index: int) -> None:
        try:
            await run_one(index)
        finally:
            slots.release()

    for index, at in enumerate(arrivals):
        await asyncio.sleep(max(0.0, begin + at - loop.time()))
        await slots.acquire()
        tasks.append(asyncio.create_task(run_slotted(index)))
    await asyncio.gather(*tasks)
    return results


def _client(base_url: str, api_key: str | None, timeout_s: float, pool_size: int) -> httpx.AsyncClient:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size),
        # A proxy from the environment would sit in the measured path; benchmarks talk direct.
        trust_env=False,
    )


async def run_setting(
    base_url: str,
    spec: BenchRequestSpec,
    *,
    concurrency: int,
    request_rate: float,
    num_requests: int,
    seed: int,
    api_key: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run one concurrency/rate setting and return its summary (see `summarize_setting`)."""
    from tqdm import tqdm

    closed_loop = math.isinf(request_rate)
    arrivals = None if closed_loop else poisson_arrivals(num_requests, request_rate, random.Random(seed))
    label = f"c={concurrency}" + ("" if closed_loop else f" rate={request_rate:g}/s")
    async with _client(base_url, api_key, spec.timeout_s, concurrency) as client:
        with tqdm(total=num_requests, desc=label, unit="req", file=sys.stderr, disable=not progress) as bar:
            start = time.perf_counter()
            send = lambda i: _send(client, spec, seed + i)  # noqa: E731 - request i uses seed+i
            results = await _drive(send, num_requests, concurrency, arrivals, lambda _r: bar.update())
            duration_s = time.perf_counter() - start
    return summarize_setting(results, concurrency=concurrency, request_rate=request_rate, duration_s=duration_s)


async def check_reachable(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str | None:
    """None when something answers HTTP at `base_url`; otherwise a message naming the URL and the fix."""
    import httpx

    async with _client(base_url, api_key, timeout_s, 1) as client:
        try:
            await client.get("/health")
        except httpx.TransportError as exc:
            return (
                f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc}); "
                "start it with `diffuserve serve` or point --base-url at it"
            )
    return None


# -- 5. entry point ---------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> str | None:
    if not str(args.base_url).startswith(("http://", "https://")):
        return f"--base-url must start with http:// or https://, got {args.base_url!r}"
    for flag, value in (
        ("--num-requests", args.num_requests),
        ("--n", args.n),
        ("--timeout-s", args.timeout_s),
    ):
        if value is None or value <= 0:
            return f"{flag} must be > 0, got {value}"
    if args.warmup_requests < 0:
        return f"--warmup-requests must be >= 0, got {args.warmup_requests}"
    return None


def _compare(args: argparse.Namespace) -> int:
    """`--compare A.json B.json --plot out.png`: print the saved tables and overlay them; no traffic."""
    if args.plot is None:
        print("error: --compare only plots saved runs; add --plot OUT.png", file=sys.stderr)
        return 2
    try:
        for path in args.compare:
            saved = load_run(Path(path))
            endpoint = saved.get("settings", {}).get("endpoint", "images")
            print(f"== {saved['label']} ({path})\n{format_table(saved['results'], endpoint=endpoint)}")
        plot_runs([Path(p) for p in args.compare], Path(args.plot))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"plot: {args.plot}")
    return 0


async def _sweep(args: argparse.Namespace, spec: BenchRequestSpec, run: dict[str, Any], api_key: str | None) -> int:
    """Check the server answers, warm it up, then run every concurrency setting into run["results"]."""
    base_url = run["base_url"]
    unreachable = await check_reachable(base_url, api_key, min(args.timeout_s, 10.0))
    if unreachable:
        print(f"error: {unreachable}", file=sys.stderr)
        return 2
    # Distinct seeds over the whole run (see --seed): the settings' in turn, then the warm-up's.
    if args.warmup_requests:
        warm = await run_setting(
            base_url, spec, concurrency=1, request_rate=math.inf, num_requests=args.warmup_requests,
            progress=False, seed=args.seed + len(args.concurrency) * args.num_requests, api_key=api_key,
        )  # fmt: skip
        print(f"warmup: {warm['completed']}/{args.warmup_requests} ok" + "".join(f"; {e}" for e in warm["errors"]))
    for k, concurrency in enumerate(args.concurrency):
        hits = await result_cache_hits(base_url, api_key)
        result = await run_setting(
            base_url, spec, concurrency=concurrency, request_rate=args.request_rate, num_requests=args.num_requests,
            progress=not args.no_progress, seed=args.seed + k * args.num_requests, api_key=api_key,
        )  # fmt: skip
        after = await result_cache_hits(base_url, api_key)
        if hits is not None and after is not None and after > hits:
            result["result_cache_hits"] = int(after - hits)
            print(
                f"warning: c={concurrency}: the server's exact-result cache answered {int(after - hits)} request(s) "
                'during this setting (diffuserve_result_cache_requests_total{outcome="hit"} at /metrics): they '
                "never ran the model, so its throughput is overstated. Another client repeating these seeds, or an "
                "earlier run with the same --seed, filled the cache: pass another --seed, or serve without "
                "--result-cache-mib.",
                file=sys.stderr,
            )
        run["results"].append(result)
    return 0


async def result_cache_hits(base_url: str, api_key: str | None) -> float | None:
    """The server's exact-result cache hits so far (`/metrics`); None when it has no cache or does not say."""
    import httpx

    async with _client(base_url, api_key, 10.0, 1) as client:
        try:
            response = await client.get("/metrics")
        except httpx.HTTPError:
            return None
    if response.status_code != 200:
        return None
    for line in response.text.splitlines():
        if line.startswith('diffuserve_result_cache_requests_total{outcome="hit"}'):
            return float(line.rsplit(" ", 1)[-1])
    return None


def run_bench(args: argparse.Namespace) -> int:
    """Run `diffuserve bench` with parsed flags: 0 when every request succeeded (or --allow-failures),
    1 when requests failed, 2 for bad flags or an unreachable server."""
    if args.compare:
        return _compare(args)
    if isinstance(args.concurrency, str):  # tolerate a Namespace built without our argparse types
        args.concurrency = parse_concurrency(args.concurrency)
    if isinstance(args.request_rate, str):
        args.request_rate = parse_rate(args.request_rate)
    problem = _check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    spec = BenchRequestSpec(
        endpoint=args.endpoint, prompt=args.prompt, model=args.model, size=args.size, steps=args.steps,
        n=args.n, num_frames=args.num_frames, timeout_s=args.timeout_s,
    )  # fmt: skip
    settings = {k: v for k, v in asdict(spec).items() if k != "poll_interval_s"}
    settings.update(
        num_requests=args.num_requests, concurrency=list(args.concurrency), seed=args.seed,
        request_rate="inf" if math.isinf(args.request_rate) else args.request_rate,
        warmup_requests=args.warmup_requests,
    )  # fmt: skip
    label = args.label or (Path(args.output_json).stem if args.output_json else "run")
    run: dict[str, Any] = {"label": label, "base_url": str(args.base_url).rstrip("/"), "settings": settings}
    run["results"] = []
    api_key = args.api_key or os.environ.get("DIFFUSERVE_API_KEY") or None
    status = asyncio.run(_sweep(args, spec, run, api_key))
    if status:
        return status

    print(f"== {label}: {args.endpoint} at {run['base_url']}, {args.num_requests} requests per setting")
    print(format_table(run["results"], endpoint=args.endpoint))
    failed = 0
    for row in run["results"]:
        if row["failed"]:
            failed += row["failed"]
            print(f"c={row['concurrency']}: {row['failed']} failed; first errors: " + " | ".join(row["errors"]))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(run, indent=2) + "\n")
        print(f"json: {args.output_json}")
    if args.plot:
        plot_results([run], Path(args.plot))
        print(f"plot: {args.plot}")
    if failed and not args.allow_failures:
        # Rule: any failed request of the sweep (warm-up requests aside) fails the run, so a script or CI
        # job never mistakes a run with errors for a measurement; --allow-failures keeps exit 0.
        print(f"error: {failed} request(s) failed; exiting 1 (pass --allow-failures to exit 0 anyway)", file=sys.stderr)
        return 1
    return 0
