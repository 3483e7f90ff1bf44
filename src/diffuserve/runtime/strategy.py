"""The base of every residency strategy: one component's mode, its hooks, and the guard.

A `Strategy` is how one component behaves under its plan (resident, whole-component offload,
layer-wise offload). Behaviour is added through named, removable diffusers hooks; the guard hook
refuses a forward of an offloaded component outside `residency.use(...)`, naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.hooks import HookRegistry, ModelHook

from diffuserve.config.plan import ComponentPlan, ResidencyMode
from diffuserve.runtime.weights import Transfers, collect_slots

GUARD_HOOK = "diffuserve.residency.guard"
"""Name of the hook that refuses a forward of an offloaded component outside `use`."""


class OffloadedWeightsError(RuntimeError):
    """A module ran while its weights were offloaded (outside `residency.use(...)`)."""


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
