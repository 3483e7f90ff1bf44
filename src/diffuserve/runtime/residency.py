"""ComponentResidencyManager: where each component's weights live, moved around each pipeline stage.

Pipelines wrap every stage in `with pipeline.residency.use("<component key>"):`. The manager does
what the deployment plan says for that component:

- `resident`: placed on the device once at setup; `use` does nothing.
- `component-offload`: the whole component moves host->device on entering `use` and back on exit.
- `snapshot-offload`: a host copy is kept for good; entering copies it to the device, exiting only
  drops the device copy (no device->host copy).
- `layerwise-offload`: declared layers stream through the device (see layerwise.py).

The moving of tensors is in weights.py and the strategy base and guard in strategy.py, below this
module and layerwise.py, so imports point one way (residency -> layerwise -> strategy -> weights).

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
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

import torch

from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.errors import ConfigError
from diffuserve.runtime.layerwise import LayerwiseStrategy, default_layer_specs
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.runtime.strategy import GUARD_HOOK, OffloadedWeightsError, Strategy
from diffuserve.runtime.weights import Transfers, WeightUnit, collect_slots

__all__ = ["GUARD_HOOK", "ComponentResidencyManager", "OffloadedWeightsError", "build_residency"]

logger = logging.getLogger(__name__)


# 1. Whole-component strategies (layer-wise offload is in layerwise.py) ----------------------------


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
            self.name,
            None,
            list(collect_slots(self.module.modules()).values()),
            self.transfers,
            keep_host=self.mode is ResidencyMode.SNAPSHOT_OFFLOAD,
            pin_memory=self.plan.pin_memory,
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

    def settle(self) -> None:
        """End a temporary offload: the weights go back on the device for good and the hooks come off."""
        self.unit.load()
        super().close()


# 2. The manager ---------------------------------------------------------------------------------


def _flag_for_permanent(name: str, plan: ComponentPlan) -> str:
    if plan.mode is ResidencyMode.LAYERWISE_OFFLOAD:
        if plan.group == "dit":
            return "--dit-layerwise-residency-lifetime"
        return "--layerwise-residency-lifetime"
    return "--component-residency"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


class ComponentResidencyManager:
    """Implements the pipeline's `Residency` protocol from per-component plans."""

    def __init__(
        self,
        components: dict[str, torch.nn.Module],
        plans: dict[str, ComponentPlan],
        *,
        device: torch.device | str,
        ledger: TransferLedger,
        layer_specs: dict[str, list[str]] | None = None,
        device_budget_bytes: int | None = None,
        offload_during_compile: bool = False,
    ) -> None:
        self.offload_during_compile = offload_during_compile
        self.in_compile_warmup = False
        """True inside compile_warmup() (the other ranks of a replica enter theirs for the same calls)."""
        """Whether `compile_warmup()` offloads the resident components (the plan's compile settings)."""
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

    @contextlib.contextmanager
    def compile_warmup(self) -> Iterator[None]:
        """Placement for the torch.compile warm-up (`--offload-during-compile`).

        Inside, every resident component — the DiT and the non-DiT ones alike — is temporarily
        component-offloaded: its weights go to the host (recorded `d2h`) and come on only while the
        warm-up generation uses it, so compilation and autotuning run beside one component's weights
        instead of the whole model. Components the plan already offloads keep their mode. On exit the
        serving residency is restored (recorded `h2d`), before the engine reports ready. A no-op when
        compile or `--offload-during-compile` is off.
        """
        if not self.offload_during_compile or not self._is_setup:
            yield
            return
        evicted = self._evict_resident()
        self.in_compile_warmup = True
        try:
            yield
        finally:
            self.in_compile_warmup = False
            self._restore_resident(evicted)

    def _evict_resident(self) -> dict[str, Strategy]:
        evicted: dict[str, Strategy] = {}
        for name, strategy in list(self.strategies.items()):
            if not isinstance(strategy, ResidentStrategy):
                continue
            plan = dataclasses.replace(strategy.plan, mode=ResidencyMode.COMPONENT_OFFLOAD)
            temporary = WholeOffloadStrategy(name, strategy.module, plan, self.transfers)
            temporary.unit.evict()
            temporary.add_guards()
            self.strategies[name] = temporary
            evicted[name] = strategy
        logger.info("compile warm-up: %s offloaded to host until warm-up ends", sorted(evicted))
        return evicted

    def _restore_resident(self, evicted: dict[str, Strategy]) -> None:
        for name, original in evicted.items():
            temporary = self.strategies[name]
            assert isinstance(temporary, WholeOffloadStrategy)
            temporary.settle()
            self.strategies[name] = original
        logger.info("compile warm-up done: serving residency restored (%s resident again)", sorted(evicted))

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
        modules,
        plans,
        device=device,
        ledger=ledger,
        layer_specs=layer_specs,
        device_budget_bytes=device_budget_bytes,
        offload_during_compile=plan.enable_torch_compile and plan.offload_during_compile,
    )
    manager.setup()
    return manager
