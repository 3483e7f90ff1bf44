"""The soak's report (benchmarks/soak.py): requests by kind and outcome, latency p50 / p99 per kind, RSS and open
file descriptors per server over time, and the goals, each with its value, limit and verdict.

Windows: the first `warmup_share` of the run is warm-up (checkpoints load, caches and allocator pools fill). The
baseline is the median of the samples in the window right after it (as long as the warm-up), the end the median of
the last window of the same length; growth compares the two medians, never single samples.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass

from soak_kinds import KINDS, OUTCOMES, Record

FIVE_XX = ("error_5xx", "job_failed")


@dataclass
class Sample:
    """One look at a server process (its children included) `at` seconds into the run."""

    server: str
    at: float
    rss_bytes: int
    fds: int
    threads: int
    load1: float


@dataclass
class Limits:
    warmup_share: float = 0.2
    rss_growth_max: float = 0.05
    fd_growth_max: int = 8
    """Open fds may differ by this many between the windows' medians (connections come and go with the clients)."""
    fault_grace_s: float = 5.0
    """A request that ends within this long after the store resumed still counts as inside the fault window."""


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def in_fault(record: Record, fault: dict | None, grace_s: float) -> bool:
    if not fault:
        return False
    return record.started <= fault["resumed_at"] + grace_s and record.ended >= fault["stopped_at"]


def _kinds(records: list[Record]) -> dict[str, dict]:
    out = {}
    for kind in KINDS:
        mine = [r for r in records if r.kind == kind]
        done = [r.ended - r.started for r in mine if r.outcome in ("ok", "cancelled")]
        p50, p99 = quantile(done, 0.5), quantile(done, 0.99)
        out[kind] = {
            "requests": len(mine),
            "outcomes": dict(Counter(r.outcome for r in mine)),
            "p50_s": None if p50 is None else round(p50, 3),
            "p99_s": None if p99 is None else round(p99, 3),
        }
    return out


def _window(samples: list[Sample], start: float, end: float, attr: str) -> float | None:
    values = [getattr(s, attr) for s in samples if start <= s.at < end]
    return statistics.median(values) if values else None


def _servers(samples: list[Sample], duration_s: float, limits: Limits) -> dict[str, dict]:
    span = duration_s * limits.warmup_share
    out = {}
    for server in sorted({s.server for s in samples}):
        mine = [s for s in samples if s.server == server]
        entry: dict = {"samples": len(mine), "first_rss_mib": round(mine[0].rss_bytes / 2**20, 1)}
        for attr, unit in (("rss_bytes", 2**20), ("fds", 1), ("threads", 1)):
            base = _window(mine, span, 2 * span, attr)
            end = _window(mine, duration_s - span, math.inf, attr)
            name = "rss_mib" if attr == "rss_bytes" else attr
            entry[f"{name}_baseline"] = None if base is None else round(base / unit, 1)
            entry[f"{name}_end"] = None if end is None else round(end / unit, 1)
            entry[f"{name}_max"] = round(max(getattr(s, attr) for s in mine) / unit, 1)
        base, end = entry["rss_mib_baseline"], entry["rss_mib_end"]
        entry["rss_growth"] = None if not base or end is None else round(end / base - 1, 4)
        fb, fe = entry["fds_baseline"], entry["fds_end"]
        entry["fd_growth"] = None if fb is None or fe is None else fe - fb
        out[server] = entry
    return out


def _goals(records: list[Record], servers: dict, fault: dict | None, limits: Limits, ledger: list[str]) -> list:
    lost = [r for r in records if r.outcome == "lost"]
    five = [r for r in records if r.outcome in FIVE_XX]
    outside = [r for r in five if not in_fault(r, fault, limits.fault_grace_s)]
    bad_4xx = [r for r in records if r.outcome == "error_4xx"]
    goals = [
        {"goal": "lost requests", "value": len(lost), "limit": 0},
        {"goal": "server findings (unfinished jobs, exit codes, log errors)", "value": len(ledger), "limit": 0},
        {"goal": "5xx outside the fault window", "value": len(outside), "limit": 0},
        {"goal": "unexpected 4xx (not 429)", "value": len(bad_4xx), "limit": 0},
        {"goal": "kinds with no answered request", "value": 0, "limit": 0},
    ]
    answered = {r.kind for r in records if r.outcome in ("ok", "cancelled", "disconnected")}
    goals[4]["value"] = len(set(KINDS) - answered)
    for name, entry in servers.items():
        growth, fds = entry["rss_growth"], entry["fd_growth"]
        goals.append({"goal": f"RSS growth after warm-up: {name}", "value": growth, "limit": limits.rss_growth_max})
        goals.append({"goal": f"open fds growth: {name}", "value": fds, "limit": limits.fd_growth_max})
    for goal in goals:
        goal["ok"] = goal["value"] is not None and goal["value"] <= goal["limit"]
    return goals


def build(
    records: list[Record],
    samples: list[Sample],
    fault: dict | None,
    meta: dict,
    limits: Limits,
    ledger: list[str],
) -> dict:
    """The whole report (JSON-ready); `ledger` lists the server-side findings of the end-of-run check."""
    servers = _servers(samples, meta["duration_s"], limits)
    five = [r for r in records if r.outcome in FIVE_XX]
    inside = [r for r in five if in_fault(r, fault, limits.fault_grace_s)]
    goals = _goals(records, servers, fault, limits, ledger)
    findings = [asdict(r) for r in records if r.outcome in ("lost", "error_4xx", *FIVE_XX)]
    return {
        **meta,
        "limits": asdict(limits),
        "requests": len(records),
        "outcomes": {o: sum(r.outcome == o for r in records) for o in OUTCOMES},
        "five_xx_in_fault_window": len(inside),
        "load1_median": statistics.median(s.load1 for s in samples) if samples else None,
        "fault": fault,
        "kinds": _kinds(records),
        "servers": servers,
        "ledger": ledger,
        "findings": findings[:50],
        "goals": goals,
        "passed": all(g["ok"] for g in goals),
        "samples": [asdict(s) for s in samples],
    }


def table(report: dict) -> str:
    """The summary printed at the end of a run."""
    lines = [f"soak: {report['duration_s']:.0f} s, {report['requests']} requests, store: {report['store']}"]
    lines.append(
        f"load average at start {report['load_at_start']}, at end {report['load_at_end']} ({report['cpus']} cpus)"
    )
    lines.append(f"{'kind':<14}{'n':>6}{'p50 s':>9}{'p99 s':>9}  outcomes")
    for kind, entry in report["kinds"].items():
        p50 = "-" if entry["p50_s"] is None else f"{entry['p50_s']:.3f}"
        p99 = "-" if entry["p99_s"] is None else f"{entry['p99_s']:.3f}"
        outcomes = " ".join(f"{k}={v}" for k, v in sorted(entry["outcomes"].items()))
        lines.append(f"{kind:<14}{entry['requests']:>6}{p50:>9}{p99:>9}  {outcomes}")
    lines.append("outcomes: " + " ".join(f"{k}={v}" for k, v in report["outcomes"].items()))
    lines.append(f"5xx inside the fault window: {report['five_xx_in_fault_window']} (fault: {report['fault']})")
    lines.append(
        f"{'server':<8}{'RSS MiB first':>14}{'baseline':>10}{'end':>8}{'max':>8}{'growth':>9}{'fds':>12}{'threads':>10}"
    )
    for name, e in report["servers"].items():
        growth = "-" if e["rss_growth"] is None else f"{e['rss_growth'] * 100:+.1f}%"
        fds = f"{e['fds_baseline']:.0f}->{e['fds_end']:.0f}" if e["fds_end"] is not None else "-"
        threads = f"{e['threads_baseline']:.0f}->{e['threads_end']:.0f}" if e["threads_end"] is not None else "-"
        base = "-" if e["rss_mib_baseline"] is None else f"{e['rss_mib_baseline']:.0f}"
        end = "-" if e["rss_mib_end"] is None else f"{e['rss_mib_end']:.0f}"
        lines.append(
            f"{name:<8}{e['first_rss_mib']:>14.0f}{base:>10}{end:>8}{e['rss_mib_max']:>8.0f}{growth:>9}{fds:>12}{threads:>10}"
        )
    for finding in report["ledger"]:
        lines.append(f"ledger: {finding}")
    for f in report["findings"][:10]:
        lines.append(f"finding: {f['kind']} {f['outcome']} {f['status']} at {f['started']:.1f}s: {f['detail']}")
    for goal in report["goals"]:
        lines.append(f"{'PASS' if goal['ok'] else 'FAIL'}  {goal['goal']}: {goal['value']} (limit {goal['limit']})")
    return "\n".join(lines)
