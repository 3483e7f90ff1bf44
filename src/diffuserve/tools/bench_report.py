"""Summaries and reports of `diffuserve bench`: nearest-rank percentiles, per-setting summaries,
the printed table, and plots of saved runs (one line per labelled run)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

MAX_ERRORS_KEPT = 5
"""Distinct error messages kept per setting in the report."""
# -- 1. summary math (pure) -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    # Exact arithmetic: in floats 57.1 / 100 * 1000 is 571.0000000000001, and ceil would skip a rank.
    rank = math.ceil(Fraction(str(q)) * len(ordered) / 100)
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def summarize(values: Sequence[float], quantiles: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """`{"mean", "p50", ...}` of `values`; every figure is None when there are no values."""
    summary: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in quantiles:
        summary[f"p{q}"] = percentile(values, q) if values else None
    return summary


def poisson_arrivals(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from start) of a Poisson process at `rate` req/s; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times


@dataclass
class RequestResult:
    """The outcome of one benchmark request."""

    ok: bool = False
    """Whether the server answered with a success."""
    latency_ms: float = 0.0
    """Send to answer (videos: create to terminal status)."""
    num_images: int = 0
    """Outputs delivered (n images, or 1 per video)."""
    queue_wait_ms: float | None = None
    """`timings.queue_wait_ms` when the server reports it."""
    error: str | None = None
    """What went wrong, for failed requests."""


def summarize_setting(
    results: Sequence[RequestResult], *, concurrency: int, request_rate: float, duration_s: float
) -> dict[str, Any]:
    """One row of the report (and of the JSON `results` list) for one concurrency/rate setting."""
    done = [r for r in results if r.ok]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(r.error or "unknown error")
    waits = [r.queue_wait_ms for r in done if r.queue_wait_ms is not None]
    return {
        "concurrency": concurrency,
        # JSON has no infinity; "inf" reads back with float().
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "throughput_rps": len(done) / duration_s if duration_s > 0 else 0.0,
        # Outputs per second: images, or videos for the videos endpoint (one per job).
        "images_per_s": sum(r.num_images for r in done) / duration_s if duration_s > 0 else 0.0,
        "latency_ms": summarize([r.latency_ms for r in done]),
        "queue_wait_ms": {**summarize(waits, (50, 99)), "reported": len(waits)},
    }


# -- 2. report --------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def output_unit(endpoint: str | None) -> str:
    """What one output is called in reports: `videos` for the videos endpoint, else `img`."""
    return "videos" if endpoint == "videos" else "img"


def format_table(results: Sequence[dict[str, Any]], *, endpoint: str | None = "images") -> str:
    """The results as an aligned text table; every header carries its unit."""
    unit = output_unit(endpoint)
    header = (
        "conc",
        "rate_req/s",
        "ok",
        "fail",
        "req/s",
        f"{unit}/s",
        "lat_mean_ms",
        "lat_p50_ms",
        "lat_p90_ms",
        "lat_p99_ms",
        "qw_p50_ms",
        "qw_p99_ms",
    )
    rows = [header]
    for r in results:
        lat, wait = r["latency_ms"], r["queue_wait_ms"]
        rows.append(
            (
                str(r["concurrency"]), str(r["request_rate"]), str(r["completed"]), str(r["failed"]),
                f"{r['throughput_rps']:.2f}", f"{r['images_per_s']:.2f}", _ms(lat["mean"]), _ms(lat["p50"]),
                _ms(lat["p90"]), _ms(lat["p99"]), _ms(wait.get("p50")), _ms(wait.get("p99")),
            )
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def load_run(path: Path) -> dict[str, Any]:
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read benchmark JSON {path}: {exc}") from exc
    if not isinstance(run, dict) or not isinstance(run.get("results"), list):
        raise ValueError(f"{path} is not a `diffuserve bench --output-json` file (no `results` list)")
    run.setdefault("label", path.stem)
    return run


def plot_results(runs: Sequence[dict[str, Any]], out_png: Path) -> None:
    # Imported here: matplotlib costs a second at import and only plotting needs it. Drawing on an
    # explicit Agg canvas leaves the process-wide pyplot backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    throughput_ax, latency_ax = figure.subplots(1, 2)
    concurrencies: set[int] = set()
    for index, run in enumerate(runs):
        rows = sorted(run["results"], key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        concurrencies.update(xs)
        color = f"C{index % 10}"
        throughput_ax.plot(xs, [r["images_per_s"] for r in rows], "o-", color=color, label=run["label"])
        for key, style in (("p50", "o-"), ("p99", "s--")):
            ys = [r["latency_ms"][key] if r["latency_ms"][key] is not None else math.nan for r in rows]
            latency_ax.plot(xs, ys, style, color=color, label=f"{run['label']} {key}")
    endpoints = {run.get("settings", {}).get("endpoint", "images") for run in runs}
    ylabel = "videos / s" if endpoints == {"videos"} else ("images / s" if endpoints == {"images"} else "outputs / s")
    throughput_ax.set(title="Throughput", xlabel="concurrency", ylabel=ylabel)
    latency_ax.set(title="Latency (p50 solid, p99 dashed)", xlabel="concurrency", ylabel="ms")
    for ax in (throughput_ax, latency_ax):
        ax.set_xticks(sorted(concurrencies))
        ax.set_ylim(bottom=0)  # a zero baseline keeps small differences from looking large
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, format="png", dpi=110)


def plot_runs(json_paths: list[Path], out_png: Path) -> None:
    """Overlay saved runs (`--output-json` files) in one PNG, one line per run label."""
    runs = [load_run(Path(p)) for p in json_paths]
    seen: dict[str, int] = {}
    for run in runs:  # two runs with one label would draw indistinguishable lines
        seen[run["label"]] = seen.get(run["label"], 0) + 1
        if seen[run["label"]] > 1:
            run["label"] = f"{run['label']} ({seen[run['label']]})"
    plot_results(runs, out_png)
