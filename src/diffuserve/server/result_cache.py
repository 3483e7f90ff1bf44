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

An adapter is keyed by what it is, not by its name: the fingerprint of its weights (`LoraAdapter.fingerprint`, taken
once when the registry read them), so `a` unloaded and loaded again from another folder is another key. An entry
remembers the (name, fingerprint) of every adapter it was made with and lives only while each name still selects
those weights: the LoRA routes call `drop_stale_adapters` after every load and unload, and an answer whose adapter
changed while it ran (unloaded, replaced) is not stored. A request naming an adapter whose weights this process did
not read (being unloaded) is not cached.

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

AdapterFingerprint = Callable[[str], str | None]
"""Adapter name -> the fingerprint of the weights a request naming it gets now; None: not selectable (unknown or
being unloaded)."""
OUTCOMES = ("hit", "miss")
"""`outcome` label values of `diffuserve_result_cache_requests_total`; a request without a seed counts as a miss."""


@dataclass(frozen=True)
class CacheKey:
    """A request's place in the cache."""

    digest: str
    """The hash of the serving identity and every setting (adapters by fingerprint)."""
    adapters: tuple[tuple[str, str], ...] = ()
    """(name, fingerprint) of each adapter the request named, as they were when the key was made."""


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
    adapters: tuple[tuple[str, str], ...] = ()
    """(name, fingerprint) of the adapters it was made with: it lives while each name selects those weights."""

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
        adapters: AdapterFingerprint | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.identity = identity
        """What every key starts with: served model name, checkpoint fingerprint and the serving set-up."""
        self.ttl_s = ttl_s
        self.results = results
        self.clock = clock
        self.adapters = adapters
        """What an adapter name stands for now (the LoRA registry's fingerprints); None: adapters keyed by name."""
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

    def key(self, params: SamplingParams, *, seed_given: bool) -> CacheKey | None:
        """The request's key, or None when its output is not determined (no seed given: one was drawn) or an adapter
        it names has no fingerprint (being unloaded)."""
        if not seed_given or params.seed is None:
            return None
        adapters: list[tuple[str, str]] = []
        weights: list[list[Any]] = []  # what each adapter is, and its scale: its name decides nothing
        for name, scale in params.lora:
            fingerprint = self._fingerprint(name)
            if fingerprint is None:
                return None
            adapters.append((name, fingerprint))
            weights.append([fingerprint, scale])
        fields = {f.name: _canonical(getattr(params, f.name)) for f in dataclasses.fields(params)}
        fields["lora"] = weights
        text = json.dumps([self.identity, fields], sort_keys=True, default=repr)
        return CacheKey(hashlib.sha256(text.encode()).hexdigest(), tuple(adapters))

    def _fingerprint(self, name: str) -> str | None:
        return name if self.adapters is None else self.adapters(name)

    def _current(self, adapters: tuple[tuple[str, str], ...]) -> bool:
        """Whether each adapter name still selects the weights it did."""
        return all(self._fingerprint(name) == fingerprint for name, fingerprint in adapters)

    def lookup(self, key: CacheKey | None) -> CachedResult | None:
        """The stored answer of `key` (counted as a hit), else None (a miss). Blocking for a url entry (it asks the
        results store whether the row is still there): call it from a worker thread."""
        found = self._live(key.digest) if key is not None else None
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
        self, key: CacheKey | None, blobs: list[bytes], step_cache: dict[str, Any] | None, record_id: str | None = None
    ) -> None:
        """Keep an answer (no-op for a None key, one larger than the whole budget, or one made with an adapter that
        was unloaded or replaced while it ran); least recently used go."""
        if key is None:
            return
        entry = CachedResult(tuple(blobs), step_cache, self.clock(), record_id, key.adapters)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            if not self._current(key.adapters):
                return
            self._drop(key.digest)
            self._entries[key.digest] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._publish()

    def repoint(self, key: CacheKey, record_id: str) -> None:
        """A url hit wrote the bytes again under a new results-store row: the entry now lives as long as that one
        (its age still counts from when the result was made)."""
        with self._lock:
            entry = self._entries.get(key.digest)
            if entry is not None:
                self._entries[key.digest] = dataclasses.replace(entry, record_id=record_id)

    def drop_stale_adapters(self) -> int:
        """Drop every entry made with an adapter whose name no longer selects those weights (unloaded, or loaded
        again from other files); the LoRA routes call it after each load and unload. Returns how many went."""
        with self._lock:
            stale = [digest for digest, entry in self._entries.items() if not self._current(entry.adapters)]
            for digest in stale:
                self._drop(digest)
        return len(stale)

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
        "batch_tokens": 0,
        "stages_ms": {},
        "step_cache": step_cache,
        "result_cache": "hit",
    }


def serving_identity(args: Any, plan: dict[str, Any] | None) -> str:
    """What a key must share to be answered from the cache: the served model name, the checkpoint's fingerprint, the
    LoRA files loaded at start-up, dtype, device, backend and the deployment plan (`plan`)."""
    from diffuserve.config.lora import adapter_path
    from diffuserve.launch.setup import resolve_model_path
    from diffuserve.models.fingerprint import checkpoint_fingerprint

    loras = {name: [spec, checkpoint_fingerprint(adapter_path(spec))] for name, spec in args.lora.adapters.items()}
    return json.dumps(
        {
            "model": args.public_model_name,
            "checkpoint": checkpoint_fingerprint(resolve_model_path(args, quiet=True)),
            "loras": loras,
            "dtype": args.model.dtype,
            "device": args.model.device,
            "backend": args.model.backend,
            "plan": plan,
        },
        sort_keys=True,
        default=str,
    )


def adapter_fingerprints(lora_args: Any) -> AdapterFingerprint:
    """Adapter name -> fingerprint, from the process's LoRA registry. On the diffusers backend the pipeline reads the
    start-up adapters itself (no fingerprint here) and nothing changes at runtime (`--enable-lora-updates` is refused
    there), so a start-up name stands for its files, which `serving_identity` fingerprints."""
    from diffuserve.lora.registry import lora_registry

    registry = lora_registry(lora_args)

    def fingerprint(name: str) -> str | None:
        found = registry.fingerprint(name)
        if found is None and not lora_args.enable_lora_updates and name in lora_args.adapters:
            return f"start-up:{name}"
        return found

    return fingerprint


def build_result_cache(args: Any, results: ResultStore, registry: CollectorRegistry, plan: dict | None) -> Any:
    """The server's cache per `--result-cache-mib` (None when 0: off), retention from `--result-ttl-s`, adapters keyed
    by their fingerprints."""
    if args.http.result_cache_mib <= 0:
        return None
    return ResultCache(
        args.http.result_cache_mib << 20,
        serving_identity(args, plan),
        ttl_s=args.http.result_ttl_s,
        results=results,
        registry=registry,
        adapters=adapter_fingerprints(args.lora) if args.lora.enabled else None,
    )
