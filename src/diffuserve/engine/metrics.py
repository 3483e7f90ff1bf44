"""Engine metrics: the batching log lines and every Prometheus collector of the server.

Two pieces:

* `EngineMetrics` owns all collectors on its own `CollectorRegistry` (never the process-global default, so tests
  and several engines in one process do not collide); `/metrics` serves `render()`.
* `BatchingStats` records each dispatch into those collectors and, with
  `--enable-batching-metrics`, logs the seed's lines through the `diffuserve.batching` logger::

    Dynamic batch dispatch: size=2/8, user_max=8, queue_wait=5.12ms, stop_reason=delay
    Dynamic batch stats (last 5 dispatches): avg_size=2.80, merged_rate=60.0%, full_rate=20.0%, utilization=35.0%,
    wait_avg=3.21ms, wait_p95=5.12ms, top_rejects=none

**Sizes count outputs (rows), not requests**, because the cap they are compared with counts outputs (`n`):
`size=R/M` is the rows of the batch over `--batching-max-size` (as the seed prints it: a rule cap shows in the stop
reason, `config_cap:N`, not in the denominator), `avg_size` is rows per dispatch and `utilization` is rows over the
summed capacity. For ordinary `n=1` traffic rows and requests are the same number. A dispatch's capacity is its
effective cap, or its rows when a single request's `n` alone exceeds the cap (it runs alone; see the scheduler), so
utilization never passes 100%. `merged_rate` is the share of dispatches holding more than one *request*; `full_rate`
the share that reached their effective cap; waits are the head request's queue wait with a nearest-rank p95;
`top_rejects` lists the five commonest `reason=count` (comma separated, most frequent first, ties by name) or `none`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter as _Tally
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from diffuserve.engine.scheduler import ScheduledBatch
from diffuserve.engine.token_metrics import TokenMetrics, format_tokens
from diffuserve.runtime.cpu_time import PIPELINE_CPU

logger = logging.getLogger("diffuserve.batching")

PREFIX = "diffuserve_"
REQUEST_STATUSES = ("success", "error", "cancelled", "timeout", "rejected")
"""The usual `status` label values of `diffuserve_requests_total` (others are accepted)."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_STEP_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class EngineMetrics:
    """Every Prometheus collector of the server, on one registry (a fresh one by default). prometheus_client
    collectors are thread-safe, so the engine thread and the HTTP handlers may call these methods concurrently."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        # Requests and queue.
        self.requests = Counter(
            f"{p}requests", "Answered requests by endpoint and final status.", ["endpoint", "status"], registry=r
        )
        self.request_latency = Histogram(
            f"{p}request_latency_seconds",
            "Time from acceptance to answer.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            f"{p}queue_wait_seconds",
            "Time each request waited in the queue before running.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.error_responses = Counter(
            f"{p}error_responses",
            "Error answers by HTTP status and reason (the envelope's code): rejected "
            "requests (400, 401, 404, 413, 429, 503) as well as failed ones (500, 504).",
            ["status", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(f"{p}queue_depth", "Requests waiting in the queue.", registry=r)
        self.draining = Gauge(f"{p}draining", "1 while the engine drains (it admits nothing new).", registry=r)
        self.cancelled_before_run = Counter(
            f"{p}requests_cancelled_before_run", "Queued requests removed because the client went away.", registry=r
        )
        stopped = "Steps each batch had run when it stopped because every request in it was cancelled."
        self.stopped_batch_steps = Histogram(f"{p}stopped_batch_steps", stopped, buckets=_STEP_BUCKETS, registry=r)
        elsewhere = "Jobs running here stopped as another replica finished or deleted their row, by how it was seen."
        self.jobs_stopped_elsewhere = Counter(f"{p}jobs_stopped_elsewhere", elsewhere, ["kind", "how"], registry=r)
        self._batch_collectors(r)
        self.token_metrics = TokenMetrics(r)  # tokens per call, packed calls, padding (engine/token_metrics.py)
        # Execution.
        self.stage_seconds = Histogram(
            f"{p}stage_seconds", "Time per pipeline stage per batch.", ["stage"], buckets=_STAGE_BUCKETS, registry=r
        )
        self.outputs_generated = Counter(f"{p}outputs_generated", "Images or videos produced.", registry=r)
        self._step_cache_collectors(r)
        self._serving_overhead_collectors(r)
        self.overlap_jobs = Counter(
            f"{p}overlap_jobs",
            "Text encodes / decodes run in a side lane beside the denoise loop, by stage.",
            ["stage"],
            registry=r,
        )
        self.overlap_steps = Counter(
            f"{p}overlap_steps",
            "Denoising steps the loop ran while a side-lane job of that stage ran (0 would "
            "mean the loop waited for it).",
            ["stage"],
            registry=r,
        )
        self._placement_collectors(r)
        # LoRA: requests per adapter (counted when accepted); adapters per tier (registered, host, device).
        self.lora_requests = Counter(
            f"{p}lora_requests", "Accepted requests per LoRA adapter.", ["adapter"], registry=r
        )
        self.lora_adapters = Gauge(f"{p}lora_adapters", "LoRA adapters by tier.", ["where"], registry=r)

    def _batch_collectors(self, r: CollectorRegistry) -> None:
        """Batches: sizes, capacity, merges, stop reasons, rejections and the head's wait."""
        p = PREFIX
        self.running_batch_size = Gauge(
            f"{p}running_batch_size", "Requests in the batch running now (0 when idle).", registry=r
        )
        self.batch_size = Histogram(
            f"{p}batch_size_outputs", "Outputs (rows) per dispatched batch.", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            f"{p}batch_size_requests", "Requests per dispatched batch.", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_capacity = Counter(
            f"{p}batch_capacity_outputs",
            "Summed capacity (effective cap) of dispatched batches; utilization = batch_size_outputs_sum / this.",
            registry=r,
        )
        self.batch_dispatches = Counter(
            f"{p}batch_dispatches", "Dispatched batches by stop reason.", ["reason"], registry=r
        )
        self.batch_merged = Counter(
            f"{p}batch_merged_dispatches", "Dispatches holding more than one request.", registry=r
        )
        self.batch_full = Counter(
            f"{p}batch_full_dispatches", "Dispatches that reached their effective cap.", registry=r
        )
        self.batch_rejects = Counter(
            f"{p}batching_rejects", "Queued candidates left out of a batch, by reason.", ["reason"], registry=r
        )
        self.batch_head_wait = Histogram(
            f"{p}batch_head_queue_wait_seconds",
            "Queue wait of the head request of each dispatch.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )

    def _placement_collectors(self, r: CollectorRegistry) -> None:
        """Residency (fed by the transfer ledger), accelerator memory, replicas and multi-rank calls."""
        p = PREFIX
        self.transfer_bytes = Counter(
            f"{p}transfer_bytes", "Bytes moved between host and device.", ["component", "direction"], registry=r
        )
        self.transfer_seconds = Counter(
            f"{p}transfer_seconds",
            "Time spent moving weights between host and device.",
            ["component", "direction"],
            registry=r,
        )
        self.device_bytes = Gauge(
            f"{p}device_bytes", "Device bytes held by a component now.", ["component"], registry=r
        )
        self.device_peak_bytes = Gauge(
            f"{p}device_peak_bytes", "Peak device bytes held by a component.", ["component"], registry=r
        )
        # Memory of the process itself (process_resident_memory_bytes, CPU seconds, open fds).
        ProcessCollector(namespace=PREFIX.rstrip("_"), registry=r)
        self.accelerator_memory = Gauge(
            f"{p}accelerator_memory_bytes", "Accelerator memory of this process (CUDA allocator).", ["kind"], registry=r
        )
        self.replica_busy = Gauge(f"{p}replica_busy", "1 while a replica runs a batch.", ["replica"], registry=r)
        self.replica_healthy = Gauge(
            f"{p}replica_healthy", "1 while every rank of a replica is alive.", ["replica"], registry=r
        )
        self.replica_batches = Gauge(f"{p}replica_batches", "Batches a replica has run.", ["replica"], registry=r)
        self.replica_rows = Gauge(f"{p}replica_rows", "Output rows a replica has produced.", ["replica"], registry=r)
        overhead_buckets = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
        self.rank_call_delivery = Histogram(
            f"{p}rank_call_delivery_seconds",
            "Time a pipeline call took to reach the slowest other rank of replica 0.",
            buckets=overhead_buckets,
            registry=r,
        )
        self.rank_call_straggle = Histogram(
            f"{p}rank_call_straggle_seconds",
            "Time rank 0 waited for the other ranks to finish a call after its own part.",
            buckets=overhead_buckets,
            registry=r,
        )

    def _step_cache_collectors(self, r: CollectorRegistry) -> None:
        """Step caches: computed and reused denoising steps per method (issue 19)."""
        self.step_cache_steps = Counter(
            f"{PREFIX}step_cache_steps",
            "Denoising steps of rows that ran a step cache, by method and whether the row "
            "computed the step or reused its cache (summed over rows).",
            ["method", "outcome"],
            registry=r,
        )

    def _serving_overhead_collectors(self, r: CollectorRegistry) -> None:
        """Where the time outside the model goes (docs/operations.md, "Serving overhead")."""
        self.serving_overhead = Histogram(
            f"{PREFIX}serving_overhead_seconds",
            "Per answered request: server time outside its pipeline calls and "
            "its queue wait (HTTP parsing, token counts, scheduling, result hand-off, PNG/base64 encoding).",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.pipeline_cpu = Gauge(
            f"{PREFIX}pipeline_cpu_seconds",
            "CPU time of this process inside pipeline calls "
            "(loop and side lanes); diffuserve_process_cpu_seconds_total - this = serving CPU.",
            registry=r,
        )
        self.pipeline_cpu.set_function(lambda: PIPELINE_CPU.seconds)

    def watch_cuda_memory(self, device: str) -> None:
        """Report the CUDA allocator's bytes (allocated, peak, reserved) at every scrape."""
        import torch

        index = torch.device(device).index or 0
        readers = {
            "allocated": lambda: torch.cuda.memory_allocated(index),
            "max_allocated": lambda: torch.cuda.max_memory_allocated(index),
            "reserved": lambda: torch.cuda.memory_reserved(index),
        }
        for kind, read in readers.items():
            self.accelerator_memory.labels(kind=kind).set_function(read)

    # -- what the engine and server call ------------------------------------------------------------
    def observe_request(self, endpoint: str, status: str, latency_s: float | None = None) -> None:
        """One answered request; `latency_s` None for answers with no meaningful latency (rejections)."""
        self.requests.labels(endpoint=endpoint, status=status).inc()
        if latency_s is not None:
            self.request_latency.labels(endpoint=endpoint).observe(max(0.0, latency_s))

    def observe_error(self, status: int, reason: str) -> None:
        """One error answer sent to a client (any endpoint), by status and the envelope's `code`."""
        self.error_responses.labels(status=str(status), reason=reason).inc()

    def observe_queue_wait(self, seconds: float) -> None:
        """One request left the queue to run (call once per request, not per batch)."""
        self.queue_wait.observe(max(0.0, seconds))

    def set_queue_depth(self, n: int) -> None:
        self.queue_depth.set(n)

    def set_running(self, n: int) -> None:
        """Requests in the running batch (0 when the worker is idle)."""
        self.running_batch_size.set(n)

    def observe_replica(self, state) -> None:
        """A replica's state (executor.base.ReplicaState), mirrored from `EngineStatus` when /metrics is scraped."""
        label = str(state.replica)
        self.replica_busy.labels(replica=label).set(int(state.busy))
        self.replica_healthy.labels(replica=label).set(int(state.failed is None))
        self.replica_batches.labels(replica=label).set(state.batches)
        self.replica_rows.labels(replica=label).set(state.rows)

    def observe_rank_call(self, delivery_s: float, straggle_s: float) -> None:
        """One pipeline call on several ranks: its message delivery and the wait for the other ranks."""
        self.rank_call_delivery.observe(max(0.0, delivery_s))
        self.rank_call_straggle.observe(max(0.0, straggle_s))

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_seconds.labels(stage=stage).observe(max(0.0, seconds))

    def observe_overlap(self, stage: str, steps_beside: int) -> None:
        """One side-lane job (`encode` or `decode`) and the denoising steps that ran beside it."""
        self.overlap_jobs.labels(stage=stage).inc()
        self.overlap_steps.labels(stage=stage).inc(max(0, steps_beside))

    def observe_step_cache(self, counts: dict[str, Any] | None) -> None:
        """One answered request's step-cache counts (`RequestOutput.step_cache`); None: it ran no cache."""
        if not counts:
            return
        method = str(counts.get("method"))
        self.step_cache_steps.labels(method=method, outcome="computed").inc(int(counts.get("computed_steps", 0)))
        self.step_cache_steps.labels(method=method, outcome="reused").inc(int(counts.get("reused_steps", 0)))

    def observe_serving_overhead(self, seconds: float) -> None:
        """One answered request's server time outside its pipeline calls and queue wait."""
        self.serving_overhead.observe(max(0.0, seconds))

    def add_outputs_generated(self, n: int) -> None:
        self.outputs_generated.inc(n)

    def inc_cancelled_before_run(self, n: int = 1) -> None:
        """Requests removed from the queue (never run) because the client went away."""
        self.cancelled_before_run.inc(n)

    def record_transfer(self, component: str, direction: str, nbytes: int, seconds: float) -> None:
        """One host<->device move; `direction` is the ledger's `h2d`, `d2h` or `free`."""
        self.transfer_bytes.labels(component=component, direction=direction).inc(nbytes)
        self.transfer_seconds.labels(component=component, direction=direction).inc(max(0.0, seconds))

    def set_device_bytes(self, component: str, now: int, peak: int) -> None:
        self.device_bytes.labels(component=component).set(now)
        self.device_peak_bytes.labels(component=component).set(peak)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class BatchWindowStats:
    """The figures of one stats line (a window of dispatches)."""

    num_dispatches: int
    avg_size: float
    merged_rate: float
    """Fraction 0..1 (the line prints it as a percentage)."""
    full_rate: float
    utilization: float
    wait_avg_s: float
    wait_p95_s: float
    top_rejects: tuple[tuple[str, int], ...]


def summarize(batches: Sequence[ScheduledBatch]) -> BatchWindowStats:
    """The stats-line figures for these dispatches (see the module docstring for definitions)."""
    if not batches:
        return BatchWindowStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, ())
    k = len(batches)
    rows = sum(b.num_outputs for b in batches)
    waits = sorted(b.head_queue_wait_s for b in batches)
    tally: _Tally[str] = _Tally()
    for b in batches:
        tally.update(b.rejects)
    top = tuple(sorted(tally.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
    return BatchWindowStats(
        num_dispatches=k,
        avg_size=rows / k,
        merged_rate=sum(b.num_requests > 1 for b in batches) / k,
        full_rate=sum(b.is_full for b in batches) / k,
        utilization=rows / sum(b.capacity for b in batches),
        wait_avg_s=sum(waits) / k,
        wait_p95_s=waits[math.ceil(0.95 * k) - 1],  # nearest rank
        top_rejects=top,
    )


def format_dispatch(batch: ScheduledBatch) -> str:
    """The per-dispatch log line. A single request whose n exceeds the cap runs as several calls of at most the
    cap; its line says so (requests, rows, calls) rather than a `size=10/8` that reads as a cap violation."""
    tail = (
        f"user_max={batch.user_max}, queue_wait={batch.head_queue_wait_s * 1000:.2f}ms, stop_reason={batch.stop_reason}"
        + format_tokens(batch.num_tokens, batch.num_sizes, batch.padding_tokens, batch.token_budget)
    )
    cap = max(1, batch.effective_cap)
    if batch.num_outputs > cap:
        calls = -(-batch.num_outputs // cap)
        return (
            f"Dynamic batch dispatch: requests={batch.num_requests}, rows={batch.num_outputs} "
            f"in {calls} calls of <= {cap} rows, {tail}{_loras(batch)}"
        )
    return f"Dynamic batch dispatch: size={batch.num_outputs}/{batch.user_max}, {tail}{_loras(batch)}"


def _loras(batch: ScheduledBatch) -> str:
    """`, loras=a,b` naming the adapters the batch's rows use; empty when none does."""
    rows = (getattr(getattr(r, "params", None), "lora", ()) for r in batch.requests)  # stand-ins carry no params
    names = sorted({name for pairs in rows for name, _ in pairs})
    return f", loras={','.join(names)}" if names else ""


def format_stats(stats: BatchWindowStats) -> str:
    """The stats log line for one window."""
    rejects = ",".join(f"{reason}={count}" for reason, count in stats.top_rejects) or "none"
    return (
        f"Dynamic batch stats (last {stats.num_dispatches} dispatches): avg_size={stats.avg_size:.2f}, "
        f"merged_rate={stats.merged_rate * 100:.1f}%, full_rate={stats.full_rate * 100:.1f}%, "
        f"utilization={stats.utilization * 100:.1f}%, wait_avg={stats.wait_avg_s * 1000:.2f}ms, "
        f"wait_p95={stats.wait_p95_s * 1000:.2f}ms, top_rejects={rejects}"
    )


class BatchingStats:
    """Records every dispatch into the collectors; logs the seed's lines when enabled. Called from the engine's
    scheduling thread only (the window list is not locked)."""

    def __init__(self, metrics: EngineMetrics | None, *, log_enabled: bool, window: int = 5):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.metrics = metrics
        self.log_enabled = log_enabled
        self.window = window
        self._recent: list[ScheduledBatch] = []
        self.last_window: BatchWindowStats | None = None
        """The figures of the last completed window (kept whether or not logging is on)."""

    def record(self, batch: ScheduledBatch) -> None:
        """Record one dispatch (call when the batch is handed to the worker)."""
        m = self.metrics
        if m is not None:
            m.batch_size.observe(batch.num_outputs)
            m.batch_requests.observe(batch.num_requests)
            m.batch_capacity.inc(batch.capacity)
            m.batch_dispatches.labels(reason=batch.stop_reason).inc()
            m.batch_head_wait.observe(batch.head_queue_wait_s)
            m.token_metrics.record_batch("dynamic", batch)
            if batch.num_requests > 1:
                m.batch_merged.inc()
            if batch.is_full:
                m.batch_full.inc()
            for reason, count in batch.rejects.items():
                m.batch_rejects.labels(reason=reason).inc(count)
        if self.log_enabled:
            logger.info(format_dispatch(batch))
        self._recent.append(batch)
        if len(self._recent) >= self.window:
            self.last_window = summarize(self._recent)
            self._recent = []
            if self.log_enabled:
                logger.info(format_stats(self.last_window))


# -- continuous (step-level) batching ----------------------------------------------------------------------


def format_step(rows: int, cap: int, joined: int, left: int, active: int, tokens: str = "") -> str:
    """The per-step line of `--batching-mode continuous`: rows in this denoiser call over the group cap,
    requests that joined at this boundary, requests that left since the previous step, requests in the step."""
    return f"Continuous denoising step batch: size={rows}/{cap}, joined={joined}, left={left}, active={active}{tokens}"


class ContinuousStats:
    """The collectors and log lines of continuous batching (one object per engine, on its registry)::

    Continuous denoising step batch: size=3/8, joined=1, left=0, active=2
    Continuous denoising stats (last 20 steps): avg_size=2.85, utilization=35.6%, joins=4, leaves=3
    """

    def __init__(self, metrics: EngineMetrics, *, log_enabled: bool, window: int = 20):
        r, p = metrics.registry, PREFIX
        self.log_enabled = log_enabled
        self.window = window
        self.token_metrics = metrics.token_metrics
        self.active_rows = Gauge(
            f"{p}continuous_active_rows", "Rows in the running continuous denoise group.", registry=r
        )
        self.step_rows = Histogram(
            f"{p}continuous_step_batch_rows", "Rows per continuous denoising step.", buckets=_SIZE_BUCKETS, registry=r
        )
        self.joins = Counter(f"{p}continuous_joins", "Requests that joined a running denoise group.", registry=r)
        self.leaves = Counter(
            f"{p}continuous_leaves", "Requests that left the denoise group, by reason.", ["reason"], registry=r
        )
        self._recent: list[tuple[int, int, int, int]] = []

    def record_step(self, rows: int, cap: int, joined: int, left: int, active: int, tokens: tuple = ()) -> None:
        """One denoising step (call before it runs); `tokens`: (tokens, sizes, padding, budget) of its rows."""
        self.step_rows.observe(rows)
        if tokens:
            self.token_metrics.record("continuous", *tokens)
        self.joins.inc(joined)
        self.active_rows.set(rows)
        if self.log_enabled:
            logger.info(format_step(rows, cap, joined, left, active, format_tokens(*tokens) if tokens else ""))
        self._recent.append((rows, cap, joined, left))
        if len(self._recent) >= self.window:
            k = len(self._recent)
            total = sum(item[0] for item in self._recent)
            capacity = sum(max(item[0], item[1]) for item in self._recent)
            if self.log_enabled:
                logger.info(
                    f"Continuous denoising stats (last {k} steps): avg_size={total / k:.2f}, "
                    f"utilization={total / capacity * 100:.1f}%, joins={sum(i[2] for i in self._recent)}, "
                    f"leaves={sum(i[3] for i in self._recent)}"
                )
            self._recent = []

    def record_leave(self, reason: str, count: int = 1) -> None:
        """Requests left the group: `finished`, `cancelled`, `deadline` or `failed`."""
        self.leaves.labels(reason=reason).inc(count)

    def set_idle(self) -> None:
        self.active_rows.set(0)
