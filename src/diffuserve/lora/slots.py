"""The device tier of the adapter registry (`lora/registry.py`): a `LoraBank` whose `--max-loras` slots follow the
registered adapters, swapped between batches by the thread that runs them."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from diffuserve.lora.layers import LoraBank
from diffuserve.lora.registry import LoraRegistry

logger = logging.getLogger("diffuserve.lora")


class RegistryBank(LoraBank):
    """A `LoraBank` whose slots follow the registry: each batch's adapters are swapped in before its rows are set.

    Owned by the thread that runs the batches: `rows` (entered by the recipe around a batch's denoise) is the one
    place slots change."""

    def __init__(self, denoisers: dict[str, torch.nn.Module], registry: LoraRegistry, **geometry: Any) -> None:
        startup = registry.entries()[: registry.max_loras]
        super().__init__(denoisers, [registry.adapter(e) for e in startup], **geometry)
        self.registry = registry
        self.held: list[int | None] = [e.uid for e in startup] + [None] * (registry.max_loras - len(startup))
        """Per slot: the uid of the adapter in it (None: empty)."""
        self._names: dict[int, str] = {e.uid: e.name for e in startup}
        self._used: list[int] = [0] * registry.max_loras
        self._tick = itertools.count(1)
        self.swaps = 0
        """Adapters written into a slot after start-up (LRU swaps and runtime loads)."""
        registry.on_device = len(startup)

    def rows(self, loras: Sequence[Sequence[tuple[str, float]]]) -> AbstractContextManager[None]:
        if any(loras):
            self.swap_in(list(dict.fromkeys(name for row in loras for name, _ in row)))
        return super().rows(loras)

    def swap_in(self, names: list[str]) -> None:
        """Put every adapter in `names` into a slot (free ones first, then the least recently used ones that
        `names` does not need), and point `slots` at them. Raises ValueError naming an adapter that is gone, or
        when the batch needs more adapters than there are slots (the scheduler keeps such requests apart)."""
        if len(names) > len(self.held):
            raise ValueError(
                f"lora: a batch needs {len(names)} adapters ({', '.join(names)}) but --max-loras is {len(self.held)}"
            )
        wanted = []
        for name in names:
            entry = self.registry.get(name)
            if entry is None:
                raise ValueError(f"lora: the adapter {name!r} was unloaded before this batch ran")
            wanted.append(entry)
        live = {e.uid for e in self.registry.entries()}
        keep = {e.uid for e in wanted}
        tick = next(self._tick)
        for entry in wanted:
            if entry.uid in self.held:
                self._used[self.held.index(entry.uid)] = tick
                continue
            free = [s for s, uid in enumerate(self.held) if uid is None or uid not in live]
            spare = free or [s for s, uid in enumerate(self.held) if uid not in keep]
            slot = min(spare, key=lambda s: (self._used[s], s))
            previous = self._names.get(self.held[slot]) if self.held[slot] is not None else None
            self.place(slot, self.registry.adapter(entry))
            self.held[slot], self._used[slot] = entry.uid, tick
            self._names[entry.uid] = entry.name
            self.swaps += 1
            logger.info(
                "LoRA adapter %r into device slot %d%s", entry.name, slot, f" (was {previous!r})" if previous else ""
            )
        self._names = {uid: self._names[uid] for uid in self.held if uid is not None and uid in live}
        self.slots = {self._names[uid]: s for s, uid in enumerate(self.held) if uid in self._names}
        self.registry.on_device = len(self.slots)


def install_registry(
    pipeline: Any,
    family: str,
    registry: LoraRegistry,
    *,
    max_rank: int,
    device: Any,
    dtype: torch.dtype,
    runtime_updates: bool = False,
) -> RegistryBank | None:
    """Read and check the start-up adapters, hook the denoisers' adapted layers, and let the registry read runtime
    loads against the same denoisers; the pipeline's recipe then sets each batch's rows. On the diffusers backend
    the pipeline loads the start-up adapters itself and runs one adapter set per call (None: no bank; runtime
    loads are refused there). `pipeline` is a `pipelines.base.Pipeline` (typed Any: lora/ is a layer below it), read
    through its declared `denoisers`, `use_lora` and `load_lora_adapters`."""
    from diffuserve.errors import ConfigError
    from diffuserve.lora.files import lora_loader, read_adapter, split_target

    if not pipeline.denoisers:  # no native denoiser: the pipeline loads them itself (`Pipeline.load_lora_adapters`)
        if runtime_updates:
            raise ConfigError(
                f"--enable-lora-updates: the {family} pipeline on this backend takes no per-row adapters (the "
                "diffusers backend takes start-up --lora-modules only, one adapter set per call); serve it on the "
                "native backend or drop the flag."
            )
        pipeline.load_lora_adapters({e.name: e.path for e in registry.entries()})  # refuses where it cannot
        return None
    lora_loader(family)  # refused naming the family when it has no loader, even before any adapter is read
    names = tuple(pipeline.denoisers)
    denoisers = {key: pipeline.components[key] for key in names}

    def read(name: str, spec: str) -> Any:
        denoiser, path = split_target(spec, names)
        return read_adapter(name, path, family, denoisers[denoiser], max_rank=max_rank, denoiser=denoiser)

    registry.reader = read
    # Every start-up adapter is checked now, even those beyond the host LRU; the first ones (which take the device
    # slots) are kept last, so they are the ones the LRU holds.
    for entry in reversed(registry.entries()):
        registry.keep(entry, registry.read(entry.name, entry.path))
    bank = RegistryBank(
        denoisers, registry, max_loras=registry.max_loras, max_rank=max_rank, device=device, dtype=dtype
    )
    pipeline.use_lora(bank)
    return bank


def install_lora(
    pipeline: Any,
    family: str,
    adapters: dict[str, str],
    *,
    max_loras: int,
    max_rank: int,
    device: Any,
    dtype: torch.dtype,
) -> RegistryBank | None:
    """`install_registry` for a fixed set of adapters (name -> path, `transformer_2:PATH` for Wan2.2's low-noise
    expert), as `serve --lora-modules` installs them: for code that loads a pipeline itself (tests, benchmarks)."""
    registry = LoraRegistry(adapters, max_loras=max_loras, host_capacity=max(max_loras, len(adapters)))
    return install_registry(pipeline, family, registry, max_rank=max_rank, device=device, dtype=dtype)
