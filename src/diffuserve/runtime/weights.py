"""Moving one unit of weights between the host store and the device (the lowest layer of runtime/).

A `WeightUnit` is the tensors that move together (a whole component, one layer, or a component's
non-layer rest). Detaching swaps each parameter's `.data` (and each buffer) for an empty placeholder
of the same dtype on the device while the real tensor lives in a host-side store, so a forward
without onload fails. `Transfers` holds what all units of one manager share: the device, the
ledger every move is recorded in, the placeholders, the CUDA copy stream and pinned-memory copies.

The residency strategies (strategy.py, residency.py, layerwise.py) build on this module; it imports
none of them, so the imports of runtime/ point one way: residency -> layerwise -> strategy -> weights.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from diffuserve.runtime.ledger import TransferLedger


class Transfers:
    """Device-side helpers shared by all units of a manager: placeholders, copy stream, pinning."""

    def __init__(self, device: torch.device, ledger: TransferLedger) -> None:
        self.device = torch.device(device)
        self.ledger = ledger
        self.is_cuda = self.device.type == "cuda"
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._copy_stream: torch.cuda.Stream | None = None

    def placeholder(self, like: torch.Tensor) -> torch.Tensor:
        # A 0-element tensor on the device keeps `module.device`/`.dtype` answering correctly
        # while any kernel that touches it fails on the shape. (A meta tensor would not: on CPU,
        # F.linear with a meta weight silently returns garbage.)
        ph = self._placeholders.get(like.dtype)
        if ph is None:
            ph = torch.empty(0, dtype=like.dtype, device=self.device)
            self._placeholders[like.dtype] = ph
        return ph

    def copy_stream(self) -> torch.cuda.Stream | None:
        """The dedicated stream for layer prefetch (CUDA only)."""
        if self.is_cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    def to_host(self, t: torch.Tensor, pin: bool) -> torch.Tensor:
        pin = pin and self.is_cuda
        if t.device.type == "cpu":
            return t.pin_memory() if pin and not t.is_pinned() else t
        if pin:
            # Straight into pinned memory: one copy, and the next h2d can be asynchronous.
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t)
            return host
        return t.to("cpu")


@dataclass
class _Slot:
    """One distinct tensor and every place a module holds it (tied weights appear more than once)."""

    tensor_id: int
    is_param: bool
    refs: list[tuple[torch.nn.Module, str]]
    nbytes: int
    host: torch.Tensor | None = None
    device_copy: torch.Tensor | None = None

    def attach(self, t: torch.Tensor) -> None:
        for module, name in self.refs:
            if self.is_param:
                module._parameters[name].data = t  # type: ignore[union-attr]
            else:
                module._buffers[name] = t

    def current(self) -> torch.Tensor:
        module, name = self.refs[0]
        t = module._parameters[name] if self.is_param else module._buffers[name]
        assert t is not None
        return t.data if self.is_param else t


def collect_slots(modules: Iterable[torch.nn.Module]) -> dict[int, _Slot]:
    """Every parameter and buffer held directly by `modules` (not their children), by identity."""
    slots: dict[int, _Slot] = {}
    for module in modules:
        for is_param, store in ((True, module._parameters), (False, module._buffers)):
            for name, t in store.items():
                if t is None:
                    continue
                key = id(t)
                slot = slots.get(key)
                if slot is None:
                    nbytes = t.numel() * t.element_size()
                    slot = slots[key] = _Slot(key, is_param, [], nbytes)
                slot.refs.append((module, name))
    return slots


class WeightUnit:
    """Tensors that move together: a whole component, one layer, or a component's non-layer rest.

    `keep_host=True`: the host copy stays for good; unload only drops the device copy ("free").
    `keep_host=False`: weights move; unload copies them back to the host ("d2h").
    """

    def __init__(
        self,
        component: str,
        layer: str | None,
        slots: list[_Slot],
        transfers: Transfers,
        *,
        keep_host: bool,
        pin_memory: bool = False,
    ) -> None:
        self.component = component
        self.layer = layer
        self.slots = slots
        self.transfers = transfers
        self.keep_host = keep_host
        self.pin_memory = pin_memory
        self.nbytes = sum(s.nbytes for s in slots)
        self.on_device = False
        self._ready_event: torch.cuda.Event | None = None

    def capture(self) -> None:
        """Take the weights out of the module into the host store (at setup; not a recorded move)."""
        for slot in self.slots:
            slot.host = self.transfers.to_host(slot.current(), self.pin_memory)
            slot.attach(self.transfers.placeholder(slot.host))

    def load(self, *, prefetch: bool = False) -> None:
        """Attach the weights on the device. `prefetch` issues the copy on the copy stream (CUDA)."""
        if self.on_device:
            return
        tr = self.transfers
        start = time.perf_counter()
        stream = tr.copy_stream() if prefetch else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        # Non-blocking only from pinned memory, where it is truly asynchronous and safe. Copies
        # are made outside inference mode so they stay ordinary tensors whatever the caller runs.
        with ctx, torch.inference_mode(False), torch.no_grad():
            for slot in self.slots:
                assert slot.host is not None, f"{self.component}/{self.layer}: no host copy"
                dev = slot.host.to(tr.device, non_blocking=tr.is_cuda and slot.host.is_pinned())
                slot.device_copy = dev
                slot.attach(dev)
                if not self.keep_host:
                    slot.host = None
            if stream is not None:
                self._ready_event = torch.cuda.Event()
                self._ready_event.record(stream)
        self.on_device = True
        tr.ledger.record(self.component, self.layer, self.nbytes, "h2d", time.perf_counter() - start)

    def evict(self) -> None:
        """Take weights that are attached on the device now (a resident component) off it, as a recorded
        move: `unload` with the module's current tensors as the device copies. (`capture` is for weights
        that were never placed.)"""
        if self.on_device:
            return
        for slot in self.slots:
            slot.device_copy = slot.current()
        self.on_device = True
        self.unload()

    def ready(self) -> None:
        """Make the compute stream wait for a prefetch of this unit (no-op on CPU or when synchronous)."""
        event, self._ready_event = self._ready_event, None
        if event is None:
            return
        compute = torch.cuda.current_stream(self.transfers.device)
        compute.wait_event(event)
        for slot in self.slots:
            # The copy stream allocated these; tell the allocator the compute stream uses them so
            # their memory is not reused before the layer's kernels finish.
            if slot.device_copy is not None:
                slot.device_copy.record_stream(compute)

    def unload(self) -> None:
        """Detach from the device: free (host copy kept) or move back to the host."""
        if not self.on_device:
            return
        tr = self.transfers
        start = time.perf_counter()
        self.ready()  # never drop or copy back a tensor whose prefetch is still in flight
        with torch.inference_mode(False), torch.no_grad():
            for slot in self.slots:
                dev = slot.device_copy
                assert dev is not None
                if not self.keep_host:
                    # Blocking on purpose: the host copy may feed the next h2d from another stream.
                    slot.host = tr.to_host(dev, self.pin_memory)
                slot.attach(tr.placeholder(dev))
                slot.device_copy = None
        self.on_device = False
        direction = "free" if self.keep_host else "d2h"
        tr.ledger.record(self.component, self.layer, self.nbytes, direction, time.perf_counter() - start)

    def restore(self) -> None:
        """Give the module its weights back on the host (used by close(); hooks are gone then)."""
        self.unload()
        for slot in self.slots:
            if slot.host is not None:
                slot.attach(slot.host)
