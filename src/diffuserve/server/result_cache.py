"""The exact-result cache (`--result-cache-mib N`, off by default): a request whose output is fully determined is
answered from the encoded output of an earlier equal request instead of running the model again.

Where it lives, and why there: between the routes and the engine, owned by the server (`ServerContext.result_cache`,
one per process). It keeps the *encoded* outputs (the bytes a response carries), which only the server makes; the
engine never learns of a hit, so batching, step caches and metrics of the model's work are untouched.

"Fully determined" means the request gave a `seed` (without one the server draws a random seed: never a hit), and
the key is a hash of everything else that decides the bytes: every `SamplingParams` field (prompts, negative prompt,
size, steps, guidance, true CFG, flow shift, LoRA adapters and scales, the step cache and its options, the input
images' bytes, output format and quality, ...), the served model name, a fingerprint of the checkpoint's content
(`models/fingerprint.py`) and of the LoRA files loaded at start-up, and the dtype, device, backend and deployment
plan. So a restart with another `--served-model-name`, another checkpoint or another plan never reuses an entry (the
cache is in memory anyway: a restart starts empty).

Retention follows the results store's: an entry is dropped once `--result-ttl-s` has passed since its result was
made (the age at which the store expires its results), and an entry made for a `response_format=url` request is
dropped once the store no longer holds that result (expired, evicted by its caps, or deleted). Bounded by N MiB of
encoded bytes, least recently used first. Thread-safe: one lock around the table (lookups from worker threads).
Equal requests in flight together both run (no in-flight merging). Images and edits only; video jobs are not cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from diffuserve.sampling import SamplingParams
from diffuserve.storage import ResultStore

OUTCOMES = ("hit", "miss")
"""`outcome` label values of `diffuserve_result_cache_requests_total`; a request without a seed counts as a miss."""


@dataclass(frozen=True)
class CachedResult:
    """One stored answer."""

    blobs: tuple[bytes, ...]
    """The encoded outputs, in order (what the response carries, as bytes)."""
    step_cache: dict[str, Any] | None
    """The step-cache counts of the run that made it (shown again in a hit's `timings`)."""
    made_at: float
    """Wall-clock time the result was made (`time.time()`), from which retention counts."""
    record_id: str | None = None
    """The results-store row of a `response_format=url` answer: the entry lives no longer than that row."""

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)


def _canonical(value: Any) -> Any:
    """A JSON-able form of a `SamplingParams` value; bytes (input images) become their SHA-256."""
    if isinstance(value, bytes):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    if isinstance(value, tuple | list):
        return [_canonical(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


class ResultCache:
    """An LRU table key -> `CachedResult`, bounded by `max_bytes` of encoded output (see the module docstring)."""

    def __init__(
        self,
        max_bytes: int,
        identity: str,
        *,
        ttl_s: float = 0.0,
        results: ResultStore | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_bytes = max_bytes
        self.identity = identity
        """What every key starts with: served model name, checkpoint fingerprint and the serving set-up."""
        self.ttl_s = ttl_s
        self.results = results
        self.clock = clock
        self._entries: OrderedDict[str, CachedResult] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "diffuserve_result_cache_requests",
            "Requests the exact-result cache was asked about (--result-cache-mib), by outcome: hit or miss.",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.size_bytes = Gauge(
            "diffuserve_result_cache_bytes", "Encoded bytes the result cache holds.", registry=registry
        )
        self.entries = Gauge("diffuserve_result_cache_entries", "Results the result cache holds.", registry=registry)

    def key(self, params: SamplingParams, *, seed_given: bool) -> str | None:
        """The request's key, or None when its output is not determined (no seed given: one was drawn)."""
        if not seed_given or params.seed is None:
            return None
        fields = {f.name: _canonical(getattr(params, f.name)) for f in dataclasses.fields(params)}
        text = json.dumps([self.identity, fields], sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()

    def lookup(self, key: str | None) -> CachedResult | None:
        """The stored answer of `key` (counted as a hit), else None (a miss). Blocking for a url entry (it asks the
        results store whether the row is still there): call it from a worker thread."""
        found = self._live(key) if key is not None else None
        self.requests.labels("hit" if found is not None else "miss").inc()
        return found

    def _live(self, key: str) -> CachedResult | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        expired = self.ttl_s > 0 and self.clock() >= entry.made_at + self.ttl_s
        gone = entry.record_id is not None and self.results is not None and self.results.get(entry.record_id) is None
        with self._lock:
            if expired or gone:
                self._drop(key)
                return None
            if key in self._entries:
                self._entries.move_to_end(key)
        return entry

    def store(
        self, key: str | None, blobs: list[bytes], step_cache: dict[str, Any] | None, record_id: str | None = None
    ) -> None:
        """Keep an answer (no-op for a None key, or one larger than the whole budget); least recently used go."""
        if key is None:
            return
        entry = CachedResult(tuple(blobs), step_cache, self.clock(), record_id)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            self._drop(key)
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._publish()

    def repoint(self, key: str, record_id: str) -> None:
        """A url hit wrote the bytes again under a new results-store row: the entry now lives as long as that one
        (its age still counts from when the result was made)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries[key] = dataclasses.replace(entry, record_id=record_id)

    def _drop(self, key: str) -> None:
        """Remove `key` (lock held)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._publish()

    def _publish(self) -> None:
        self.size_bytes.set(self._bytes)
        self.entries.set(len(self._entries))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def cached_timings(step_cache: dict[str, Any] | None, received: float) -> dict[str, Any]:
    """The `timings` of a hit: no queue, no model call, no encode (`batch_size` 0: it ran in no batch); the step-cache
    counts are those of the run that made the result."""
    return {
        "queue_wait_ms": 0.0,
        "inference_ms": 0.0,
        "encode_ms": 0.0,
        "total_ms": round((time.monotonic() - received) * 1000, 3),
        "batch_size": 0,
        "batch_requests": 0,
        "batch_rows": 0,
        "pipeline_calls": 0,
        "stages_ms": {},
        "step_cache": step_cache,
        "result_cache": "hit",
    }


def serving_identity(args: Any, plan: dict[str, Any] | None) -> str:
    """What a key must share to be answered from the cache: the served model name, the checkpoint's fingerprint, the
    LoRA files loaded at start-up, dtype, device, backend and the deployment plan (`plan`)."""
    from diffuserve.launch.setup import resolve_model_path
    from diffuserve.models.fingerprint import checkpoint_fingerprint

    loras = {name: checkpoint_fingerprint(path) for name, path in args.lora.adapters.items()}
    return json.dumps(
        {
            "model": args.public_model_name,
            "checkpoint": checkpoint_fingerprint(resolve_model_path(args, quiet=True)),
            "loras": loras,
            "dtype": args.dtype,
            "device": args.device,
            "backend": args.backend,
            "plan": plan,
        },
        sort_keys=True,
        default=str,
    )


def build_result_cache(args: Any, results: ResultStore, registry: CollectorRegistry, plan: dict | None) -> Any:
    """The server's cache per `--result-cache-mib` (None when 0: off), retention from `--result-ttl-s`."""
    if args.result_cache_mib <= 0:
        return None
    return ResultCache(
        args.result_cache_mib << 20,
        serving_identity(args, plan),
        ttl_s=args.result_ttl_s,
        results=results,
        registry=registry,
    )
