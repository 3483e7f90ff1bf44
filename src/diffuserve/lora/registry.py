"""The adapters a server knows, where their weights are, and who may change what.

Three tiers, as in vLLM:

* **registered** (`LoraRegistry.entries`): every adapter requests may name: the start-up ones (`--lora-modules`) and
  the runtime-loaded ones (`POST /v1/load_lora_adapter`). Changed by the HTTP handlers, under the registry's lock.
* **host** (`LoraRegistry.adapter`): the checked A / B tensors of at most `--max-cpu-loras` adapters, an LRU; a
  registered adapter not in it is read from disk again (through diffusers) when a batch needs it.
* **device** (`RegistryBank`, `lora/slots.py`): the `--max-loras` slots of every adapted layer. Only the thread
  that runs the batches writes them: before a batch's denoise, every adapter the batch names and no slot holds is
  written into a free slot, else into the least recently used slot the batch does not need. The HTTP thread never
  touches a slot, so a load or unload cannot race a running denoise; an unloaded adapter's slot is simply free for
  the next swap.

Each load gets its own `uid`: an adapter unloaded and loaded again under the same name (another file) is another
adapter, and a slot still holding the old one is rewritten before use. Each entry also carries the `fingerprint` of
its weights (`LoraAdapter.fingerprint`, taken when they are read): what the exact-result cache keys an adapter by.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffuserve.lora.files import LoraAdapter

logger = logging.getLogger("diffuserve.lora")

Reader = Callable[[str, str], LoraAdapter]
"""(name, path) -> the adapter read through diffusers and checked against the served transformer (raises
ConfigError naming the first module that does not fit)."""

_uids = itertools.count(1)
_CREATE = threading.Lock()


@dataclass
class AdapterEntry:
    """One registered adapter."""

    name: str
    """What requests select it by (`lora`, or `model`)."""
    path: str
    """The file or folder it is read from (again, after a host-LRU eviction)."""
    runtime: bool
    """Loaded through POST /v1/load_lora_adapter (else --lora-modules at start-up)."""
    uid: int
    """Unique per load: a slot or host copy belongs to this load, not to the name."""
    created: float
    """Unix time of the load (the model card's `created`)."""
    unloading: bool = False
    """An unload waits for the requests that use it: new requests may no longer select it."""
    fingerprint: str | None = None
    """`LoraAdapter.fingerprint` of its weights, set when they are read (start-up, a runtime load, a re-read after a
    host-LRU eviction); None until then, and on the diffusers backend (which reads start-up adapters itself)."""


class LoraRegistry:
    """The registered adapters, the host LRU of their weights, and the adapters requests get by default.

    Thread-safe: the HTTP handlers and the batch thread share it (one lock, held only for dictionary changes; disk
    reads run outside it)."""

    def __init__(self, startup: dict[str, str], *, max_loras: int, host_capacity: int) -> None:
        self.max_loras = max_loras
        """Device slots per adapted layer (`--max-loras`): the most distinct adapters one batch may hold."""
        self.host_capacity = host_capacity
        """Adapters whose weights stay in host memory (`--max-cpu-loras`)."""
        self.reader: Reader | None = None
        """Set once the model is loaded (`install_registry`); None: no adapter can be read yet."""
        self.default: tuple[tuple[str, float], ...] = ()
        """(name, scale) pairs a request that names no adapter gets (`POST /v1/set_lora`)."""
        self.disk_reads = 0
        """Adapter reads from disk (start-up, runtime loads and host-LRU misses)."""
        self.on_device = 0
        """Slots that hold a registered adapter (the batch thread updates it)."""
        self._lock = threading.Lock()
        self._entries: dict[str, AdapterEntry] = {}
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()
        for name, path in startup.items():
            self._entries[name] = AdapterEntry(name, path, False, next(_uids), time.time())

    # -- what requests and the HTTP handlers read -------------------------------------------------------------
    def names(self) -> list[str]:
        """The adapters new requests may select, in load order."""
        with self._lock:
            return [e.name for e in self._entries.values() if not e.unloading]

    def entries(self) -> list[AdapterEntry]:
        """Every registered adapter (unloading ones too), in load order."""
        with self._lock:
            return list(self._entries.values())

    def get(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.get(name)

    def counts(self) -> dict[str, int]:
        """Adapters per tier: registered (selectable), host (weights in the LRU), device (in a slot)."""
        with self._lock:
            registered = sum(not e.unloading for e in self._entries.values())
            return {"registered": registered, "host": len(self._host), "device": self.on_device}

    # -- changes (HTTP handlers) ----------------------------------------------------------------------------
    def add(self, name: str, path: str, adapter: LoraAdapter) -> AdapterEntry:
        """Register a runtime-loaded adapter (already read and checked); KeyError when the name is taken."""
        with self._lock:
            if name in self._entries:
                raise KeyError(name)
            entry = AdapterEntry(name, path, True, next(_uids), time.time(), fingerprint=adapter.fingerprint)
            self._entries[name] = entry
            self._keep_locked(entry.uid, adapter)
        return entry

    def begin_unload(self, name: str) -> AdapterEntry:
        """New requests may no longer select `name` (it leaves the default too); KeyError when unknown."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise KeyError(name)
            entry.unloading = True
            self.default = tuple((n, s) for n, s in self.default if n != name)
            return entry

    def finish_unload(self, entry: AdapterEntry) -> None:
        """Forget an unloading adapter and its host copy (its device slot is free for the next swap)."""
        with self._lock:
            if self._entries.get(entry.name) is entry:
                del self._entries[entry.name]
            self._host.pop(entry.uid, None)

    # -- weights (batch thread, start-up) ---------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter through the installed reader (no registry change); its fingerprint is taken
        here, in the reading thread (never on the event loop, never per request)."""
        if self.reader is None:
            raise RuntimeError("the model is not loaded yet: adapters cannot be read")
        adapter = self.reader(name, path)
        _ = adapter.fingerprint
        with self._lock:
            self.disk_reads += 1
        return adapter

    def adapter(self, entry: AdapterEntry) -> LoraAdapter:
        """`entry`'s weights: from the host LRU, else read from disk again (and kept, evicting the oldest)."""
        with self._lock:
            held = self._host.get(entry.uid)
            if held is not None:
                self._host.move_to_end(entry.uid)
                return held
        adapter = self.read(entry.name, entry.path)
        logger.info("LoRA adapter %r re-read from disk (not in the host LRU of --max-cpu-loras)", entry.name)
        if entry.fingerprint not in (None, adapter.fingerprint):
            logger.warning(
                "LoRA adapter %r: %s changed on disk since it was loaded; requests now get the new weights",
                entry.name,
                entry.path,
            )
        with self._lock:
            entry.fingerprint = adapter.fingerprint  # the exact-result cache keys what the rows now get
            if self._entries.get(entry.name) is entry:
                self._keep_locked(entry.uid, adapter)
        return adapter

    def keep(self, entry: AdapterEntry, adapter: LoraAdapter) -> None:
        """Hold `entry`'s weights (read at start-up) in the host LRU, and take their fingerprint."""
        with self._lock:
            entry.fingerprint = adapter.fingerprint
            self._keep_locked(entry.uid, adapter)

    def fingerprint(self, name: str) -> str | None:
        """The fingerprint of the weights a new request naming `name` gets; None when no selectable adapter has
        that name (unknown, or being unloaded) or its weights were not read here (diffusers backend)."""
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None or entry.unloading else entry.fingerprint

    def _keep_locked(self, uid: int, adapter: LoraAdapter) -> None:
        self._host[uid] = adapter
        self._host.move_to_end(uid)
        while len(self._host) > self.host_capacity:
            self._host.popitem(last=False)


def lora_registry(lora_args: Any) -> LoraRegistry:
    """The process's registry for these `LoraArgs` (made on first use; the server and the loader share it)."""
    with _CREATE:
        if lora_args.registry is None:
            lora_args.registry = LoraRegistry(
                lora_args.adapters, max_loras=lora_args.max_loras, host_capacity=lora_args.host_capacity
            )
        return lora_args.registry
