"""ComponentResidencyManager: where each component's weights live, moved around each pipeline stage.

Pipelines wrap every stage in `with pipeline.residency.use("<component key>"):`. The manager does
what the deployment plan says for that component:

- `resident`: placed on the device once at setup; `use` does nothing.
- `component-offload`: the whole component moves host->device on entering `use` and back on exit.
- `snapshot-offload`: a host copy is kept for good; entering copies it to the device, exiting only
  drops the device copy (no device->host copy).
- `layerwise-offload`: declared layers stream through the device (see layerwise.py).

Offloaded weights are genuinely detached: each parameter's `.data` (and each buffer) is swapped for
an empty placeholder of the same dtype on the device while the real tensor lives in a host-side
store, so a forward without onload fails (guard hooks make that failure name the fix). On a
CPU-only machine the CPU is both host and device, nothing is copied, and the same attach/detach
bookkeeping runs: "device bytes" are then the bytes attached to the modules. Every move is recorded
in the TransferLedger.

All behaviour is added through named, removable diffusers hooks (`HookRegistry`); `close()` takes
them off again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from diffusers.hooks import HookRegistry, ModelHook

from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.errors import ConfigError
from diffuserve.runtime.ledger import TransferLedger

logger = logging.getLogger(__name__)

GUARD_HOOK = "diffuserve.residency.guard"
"""Name of the hook that refuses a forward of an offloaded component outside `use`."""


class OffloadedWeightsError(RuntimeError):
    """A module ran while its weights were offloaded (outside `residency.use(...)`)."""


# 1. Moving the tensors of one unit ---------------------------------------------------------------


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


# 2. Guard hook ----------------------------------------------------------------------------------


class GuardHook(ModelHook):
    """Refuses a forward while the component is not in `use` (its weights are detached)."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        self.strategy = strategy

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        if not self.strategy.in_use:
            name = self.strategy.name
            raise OffloadedWeightsError(
                f"component {name!r} is offloaded ({self.strategy.mode.value}): its weights are not "
                f"attached; run it inside `residency.use({name!r})`."
            )
        return args, kwargs


def guard_targets(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The root and its direct children: entry points such as `vae.decode` call `vae.decoder`
    without going through `vae.forward`, so the root alone is not enough."""
    return [module, *module.children()]


# 3. Per-mode strategies -------------------------------------------------------------------------


@dataclass(eq=False)
class Strategy:
    """How one component behaves; subclasses implement the modes."""

    name: str
    module: torch.nn.Module
    plan: ComponentPlan
    transfers: Transfers
    in_use: bool = False
    hooked: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    nbytes: int = 0
    """All of the component's weight bytes (counted at construction, before anything is detached)."""

    def __post_init__(self) -> None:
        self.nbytes = sum(s.nbytes for s in collect_slots(self.module.modules()).values())

    @property
    def mode(self) -> ResidencyMode:
        return self.plan.mode

    def permanent_bytes(self) -> int:
        """Device bytes held from setup on, across requests."""
        return 0

    def transient_bytes(self) -> int:
        """The most extra device bytes this component holds while it is in `use`."""
        return 0

    def setup(self) -> None: ...

    def enter(self) -> None: ...

    def exit(self) -> None: ...

    def register(self, module: torch.nn.Module, hook: ModelHook, name: str) -> None:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
        self.hooked.append((module, name))

    def add_guards(self) -> None:
        for target in guard_targets(self.module):
            self.register(target, GuardHook(self), GUARD_HOOK)

    def close(self) -> None:
        for module, name in reversed(self.hooked):
            module._diffusers_hook.remove_hook(name, recurse=False)
        self.hooked.clear()

    def describe(self) -> dict[str, object]:
        return {"mode": self.mode.value, "bytes": self.nbytes}


class ResidentStrategy(Strategy):
    def permanent_bytes(self) -> int:
        return self.nbytes

    def setup(self) -> None:
        start = time.perf_counter()
        self.module.to(self.transfers.device)
        self.transfers.ledger.record(self.name, None, self.nbytes, "h2d", time.perf_counter() - start)


class WholeOffloadStrategy(Strategy):
    """component-offload (weights move) and snapshot-offload (a host copy is kept)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.unit = WeightUnit(
            self.name, None, list(collect_slots(self.module.modules()).values()), self.transfers,
            keep_host=self.mode is ResidencyMode.SNAPSHOT_OFFLOAD, pin_memory=self.plan.pin_memory,
        )

    def transient_bytes(self) -> int:
        return self.unit.nbytes

    def setup(self) -> None:
        self.unit.capture()
        self.add_guards()

    def enter(self) -> None:
        self.unit.load()

    def exit(self) -> None:
        self.unit.unload()

    def close(self) -> None:
        super().close()
        self.unit.restore()


# 4. The manager ---------------------------------------------------------------------------------


def _flag_for_permanent(name: str, plan: ComponentPlan) -> str:
    if plan.mode is ResidencyMode.LAYERWISE_OFFLOAD:
        if plan.group == "dit":
            return "--dit-layerwise-residency-lifetime"
        return "--layerwise-residency-lifetime"
    return "--component-residency"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


class ComponentResidencyManager:
    """Implements the pipeline's `ComponentUser` protocol from per-component plans."""

    def __init__(
        self,
        components: dict[str, torch.nn.Module],
        plans: dict[str, ComponentPlan],
        *,
        device: torch.device | str,
        ledger: TransferLedger,
        layer_specs: dict[str, list[str]] | None = None,
        device_budget_bytes: int | None = None,
    ) -> None:
        from diffuserve.runtime.layerwise import LayerwiseStrategy, default_layer_specs

        self.device = torch.device(device)
        self.ledger = ledger
        self.device_budget_bytes = device_budget_bytes
        self.transfers = Transfers(self.device, ledger)
        self._lock = threading.Lock()
        self._depth: dict[str, int] = {}
        self._gates: dict[str, threading.Lock] = {}
        self._is_setup = False
        self.strategies: dict[str, Strategy] = {}
        for name, module in components.items():
            plan = plans.get(name) or ComponentPlan(name=name, group="other")
            if plan.mode is ResidencyMode.RESIDENT:
                self.strategies[name] = ResidentStrategy(name, module, plan, self.transfers)
            elif plan.mode in (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD):
                self.strategies[name] = WholeOffloadStrategy(name, module, plan, self.transfers)
            elif plan.mode is ResidencyMode.LAYERWISE_OFFLOAD:
                specs = (layer_specs or {}).get(name) or default_layer_specs(name, module)
                if not specs:
                    raise ConfigError(
                        f"layerwise-offload was requested for component {name!r} "
                        f"({type(module).__name__}), which declares no layer structure to stream; "
                        f"choose another mode with --component-residency {name}=component-offload "
                        f"(or remove it from --layerwise-offload-components).",
                        param="component_residency",
                    )
                self.strategies[name] = LayerwiseStrategy(name, module, plan, self.transfers, specs=specs)
            else:  # pragma: no cover - the enum is closed
                raise ConfigError(f"unknown residency mode {plan.mode!r} for {name!r}")

    # -- setup / teardown -----------------------------------------------------------------------

    def permanent_bytes(self) -> int:
        """Device bytes held for good: resident components and permanent resident layer sets."""
        return sum(s.permanent_bytes() for s in self.strategies.values())

    def estimated_peak_bytes(self) -> int:
        """Weights only: the permanent sets plus the largest per-use set (components run one at a
        time). Activations need headroom beyond this."""
        transient = max((s.transient_bytes() for s in self.strategies.values()), default=0)
        return self.permanent_bytes() + transient

    def check_budget(self) -> None:
        """Raise ConfigError when the plan's weights cannot fit `device_budget_bytes`."""
        budget = self.device_budget_bytes
        if budget is None:
            return
        held = {n: s.permanent_bytes() for n, s in self.strategies.items() if s.permanent_bytes()}
        permanent = sum(held.values())
        if permanent > budget:
            parts = ", ".join(
                f"{n} {_mib(b)} [{_flag_for_permanent(n, self.strategies[n].plan)}]" for n, b in held.items()
            )
            first_flag = _flag_for_permanent(*next(iter((n, self.strategies[n].plan) for n in held)))
            raise ConfigError(
                f"the permanent device sets need {_mib(permanent)} together but the device budget is "
                f"{_mib(budget)}: {parts}. Use lifetime `forward` (--layerwise-residency-lifetime "
                f"COMP=forward / --dit-layerwise-residency-lifetime forward), fewer "
                f"--layerwise-resident-layers, or --component-residency COMP=component-offload.",
                param=first_flag.lstrip("-").replace("-", "_"),
            )
        for name, s in self.strategies.items():
            need = permanent + s.transient_bytes()
            if need > budget:
                raise ConfigError(
                    f"while {name!r} runs ({s.mode.value}) the weights on the device reach {_mib(need)} "
                    f"(permanent sets {_mib(permanent)} + {_mib(s.transient_bytes())}) but the device "
                    f"budget is {_mib(budget)}; choose a lighter mode with --component-residency "
                    f"{name}=layerwise-offload or offload the resident components.",
                    param="component_residency",
                )

    def setup(self) -> None:
        """Validate the budget, then place everything as planned (permanent sets included)."""
        if self._is_setup:
            return
        self.check_budget()
        try:
            for strategy in self.strategies.values():
                strategy.setup()
        except BaseException:
            # e.g. an out-of-memory while placing a permanent set: undo what was placed.
            self.close()
            raise
        self._is_setup = True
        logger.info("residency: %s", {n: s.describe() for n, s in self.strategies.items()})

    def close(self) -> None:
        """Remove every hook and give each component its weights back (on the host for offloaded
        ones, on the device for resident ones)."""
        for strategy in self.strategies.values():
            strategy.close()
        self._is_setup = False

    # -- the pipeline's hook point ---------------------------------------------------------------

    @contextlib.contextmanager
    def use(self, component: str) -> Iterator[None]:
        """Weights of `component` are usable inside; re-entrant. Unknown components are resident."""
        strategy = self.strategies.get(component)
        if strategy is None or isinstance(strategy, ResidentStrategy):
            yield
            return
        if not self._is_setup:
            raise RuntimeError("ComponentResidencyManager.setup() must run before use()")
        # One gate per component, held across load and unload: two threads using one component (a decode in the
        # decode lane and a preview in the loop) must neither run on half-loaded weights nor see them unloaded
        # under them. Different components use different gates, so their scopes run side by side.
        with self._lock:
            gate = self._gates.setdefault(component, threading.Lock())
        with gate:
            depth = self._depth.get(component, 0)
            if depth == 0:
                strategy.in_use = True
                try:
                    strategy.enter()
                except BaseException:
                    strategy.in_use = False
                    raise
            self._depth[component] = depth + 1
        try:
            yield
        finally:
            with gate:
                self._depth[component] -= 1
                if self._depth[component] == 0:
                    strategy.in_use = False
                    strategy.exit()

    def describe(self) -> dict[str, dict[str, object]]:
        """Per component: mode, bytes and layer-wise settings, for /server_info and logs."""
        return {n: s.describe() for n, s in self.strategies.items()}


def build_residency(
    plan: DeploymentPlan,
    components: dict[str, object],
    *,
    device: torch.device | str,
    ledger: TransferLedger,
    device_budget_bytes: int | None = None,
    layer_specs: dict[str, list[str]] | None = None,
) -> ComponentResidencyManager:
    """The loader's/engine's one entry point: a set-up manager for the plan's components.

    Non-module entries of `components` are skipped; components the plan does not name stay
    resident; plan entries for components the checkpoint lacks are ignored (logged).
    """
    modules = {k: v for k, v in components.items() if isinstance(v, torch.nn.Module)}
    for name in plan.components:
        if name not in modules:
            logger.info("residency: plan names %r but the pipeline has no such module; ignored", name)
    plans = {name: plan.components[name] for name in modules if name in plan.components}
    manager = ComponentResidencyManager(
        modules, plans, device=device, ledger=ledger, layer_specs=layer_specs,
        device_budget_bytes=device_budget_bytes,
    )
    manager.setup()
    return manager
