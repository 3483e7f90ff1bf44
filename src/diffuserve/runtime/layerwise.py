"""Layer-wise offload: a component's declared repeated layers stream through the device.

A component declares its layers as dotted paths of module lists (`default_layer_specs`), e.g. a
FLUX transformer's `transformer_blocks` and `single_transformer_blocks`. Then, per forward:

- With prefetch depth P (0 is treated as 1), when layer i starts, the next P streamed layers are
  being loaded (on CUDA on a dedicated copy stream, fenced with events), and layer i is dropped
  from the device right after it runs. So at most P+1 streamed layers hold device weights at any
  moment, and each streamed layer moves host->device exactly once per forward of the component.
  Host copies are kept, so dropping a layer is free (no device->host copy).
- The first `resident_layers` declared layers are the resident set. Lifetime `forward`: placed on
  entering `use` and dropped on exit. Lifetime `permanent`: placed at setup and never moved (no
  host copy is kept for a reload that never comes).
- Weights outside the declared layers (embeddings, norms, projections) move as one unit for the
  duration of `use`, like snapshot-offload.

Prefetch follows the declared order and continues from one list into the next only when the lists
are siblings (FLUX's double blocks run straight into its single blocks), because non-sibling lists
such as a VAE's decoder and encoder do not run in one pass: prefetching across would move weights
that are never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.hooks import ModelHook

from diffuserve.config.plan import Lifetime
from diffuserve.errors import ConfigError
from diffuserve.runtime.strategy import OffloadedWeightsError, Strategy
from diffuserve.runtime.weights import WeightUnit, collect_slots

LAYER_HOOK = "diffuserve.layerwise.layer"
START_HOOK = "diffuserve.layerwise.start"


def _get(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _find_container(module: torch.nn.Module, path: str) -> str | None:
    """The full path in `module` of a declared container: `path` itself, else the one submodule whose name
    ends with `.path` (library versions nest the same encoder differently)."""
    if _get(module, path) is not None:
        return path
    matches = [name for name, _ in module.named_modules() if name.endswith("." + path)]
    return matches[0] if len(matches) == 1 else None


def default_layer_specs(component_key: str, module: torch.nn.Module) -> list[str] | None:
    """The module lists of `module` that layer-wise offload can stream, from the one layer table
    (`diffuserve.family_spec.layer_rules()`, keyed by the module's class), or None when its class declares no
    layers. `component_key` (the model_index.json key) is part of the signature for error messages."""
    from diffuserve import family_spec

    specs = []
    for path, _count in family_spec.layer_rules().get(type(module).__name__, ()):
        full = _find_container(module, path)
        sub = _get(module, full) if full is not None else None
        if isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential)) and len(sub):
            specs.append(full)
    return specs or None


def expand_layers(component: str, module: torch.nn.Module, specs: list[str]) -> list[tuple[str, str, torch.nn.Module]]:
    """(layer name, spec it came from, module) for every declared layer, in declared order."""
    layers: list[tuple[str, str, torch.nn.Module]] = []
    for spec in specs:
        sub = _get(module, spec)
        if sub is None:
            raise ConfigError(
                f"layer spec {spec!r} does not exist in component {component!r} ({type(module).__name__}); "
                f"fix the layer_specs given to the residency manager.",
                param="layer_specs",
            )
        if isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential)):
            layers.extend((f"{spec}.{i}", spec, child) for i, child in enumerate(sub))
        else:
            layers.append((spec, spec, sub))
    return layers


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


class LayerHook(ModelHook):
    """Loads its layer (and prefetches the next ones) before the layer runs; drops it after."""

    def __init__(self, streamer: LayerStreamer, index: int) -> None:
        super().__init__()
        self.streamer = streamer
        self.index = index

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        self.streamer.before(self.index)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output):
        self.streamer.after(self.index)
        return output


class StartHook(ModelHook):
    """On the component's own forward: start loading the first streamed layers early."""

    def __init__(self, streamer: LayerStreamer) -> None:
        super().__init__()
        self.streamer = streamer

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        self.streamer.kickoff()
        return args, kwargs


class LayerStreamer:
    """The per-forward state machine of one component's streamed layers."""

    def __init__(self, strategy: LayerwiseStrategy) -> None:
        self.strategy = strategy
        self.units = strategy.layer_units
        self.streamed = strategy.streamed
        depth = max(1, strategy.plan.prefetch_size)
        self.depth = depth
        # Chains of layer indices between which prefetch may flow (see module docstring).
        chains: list[list[int]] = []
        prev_spec: str | None = None
        for i, spec in enumerate(strategy.layer_spec_of):
            if prev_spec is None or (spec != prev_spec and _parent(spec) != _parent(prev_spec)):
                chains.append([])
            chains[-1].append(i)
            prev_spec = spec
        # window[i]: the streamed layers that should be on the device while layer i runs.
        self.window: list[list[int]] = [[] for _ in self.units]
        for chain in chains:
            for pos, i in enumerate(chain):
                ahead = [j for j in chain[pos + 1 :] if self.streamed[j]][:depth]
                self.window[i] = ([i] if self.streamed[i] else []) + ahead
        first_chain = chains[0] if chains else []
        self.start_window = [j for j in first_chain if self.streamed[j]][:depth]
        self.loaded: set[int] = set()

    def _check_in_use(self) -> None:
        if not self.strategy.in_use:
            name = self.strategy.name
            raise OffloadedWeightsError(
                f"component {name!r} is offloaded (layerwise-offload): its layers are not attached; "
                f"run it inside `residency.use({name!r})`."
            )

    def _set_window(self, wanted: list[int], now: int | None = None) -> None:
        # Evict first, then load: the device never holds more than the window.
        for j in sorted(self.loaded - set(wanted)):
            self.units[j].unload()
            self.loaded.discard(j)
        for j in wanted:
            if j not in self.loaded:
                # The layer about to run is loaded synchronously; the ones ahead are prefetches.
                self.units[j].load(prefetch=j != now)
                self.loaded.add(j)

    def kickoff(self) -> None:
        self._check_in_use()
        if not self.loaded:
            self._set_window(self.start_window)

    def before(self, index: int) -> None:
        self._check_in_use()
        self._set_window(self.window[index], now=index)
        self.units[index].ready()

    def after(self, index: int) -> None:
        if self.streamed[index] and index in self.loaded:
            self.units[index].unload()
            self.loaded.discard(index)

    def finish(self) -> None:
        for j in sorted(self.loaded):
            self.units[j].unload()
        self.loaded.clear()


@dataclass(eq=False)
class LayerwiseStrategy(Strategy):
    """layerwise-offload for one component (built by the residency manager)."""

    specs: list[str] = field(default_factory=list)
    layer_units: list[WeightUnit] = field(default_factory=list)
    layer_spec_of: list[str] = field(default_factory=list)
    streamed: list[bool] = field(default_factory=list)
    rest: WeightUnit | None = None
    streamer: LayerStreamer | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = expand_layers(self.name, self.module, self.specs)
        n_resident = self.plan.resident_layers
        if not 0 <= n_resident <= len(layers):
            raise ConfigError(
                f"--layerwise-resident-layers {self.name}={n_resident} is out of range: component "
                f"{self.name!r} declares {len(layers)} layers; use 0..{len(layers)}.",
                param="layerwise_resident_layers",
            )
        permanent = self.plan.lifetime is Lifetime.PERMANENT
        pin = self.plan.pin_memory
        owner: dict[int, str] = {}
        inside: set[int] = set()
        for i, (lname, spec, layer) in enumerate(layers):
            slots = collect_slots(layer.modules())
            inside.update(id(m) for m in layer.modules())
            self._claim(owner, slots, lname)
            resident = i < n_resident
            # A permanent resident layer keeps no host copy: it is never reloaded.
            unit = WeightUnit(
                self.name,
                lname,
                list(slots.values()),
                self.transfers,
                keep_host=not (resident and permanent),
                pin_memory=pin,
            )
            self.layer_units.append(unit)
            self.layer_spec_of.append(spec)
            self.streamed.append(not resident)
        rest_slots = collect_slots(m for m in self.module.modules() if id(m) not in inside)
        self._claim(owner, rest_slots, "<non-layer weights>")
        self.rest = WeightUnit(
            self.name, None, list(rest_slots.values()), self.transfers, keep_host=True, pin_memory=pin
        )
        self.streamer = LayerStreamer(self)

    def _claim(self, owner: dict[int, str], slots: dict, who: str) -> None:
        for key in slots:
            if key in owner:
                raise ConfigError(
                    f"component {self.name!r} shares a weight between {owner[key]!r} and {who!r}, so its "
                    f"layers cannot stream independently; use --component-residency "
                    f"{self.name}=component-offload.",
                    param="component_residency",
                )
            owner[key] = who

    # -- sizes ----------------------------------------------------------------------------------

    def _resident_units(self) -> list[WeightUnit]:
        return [u for u, s in zip(self.layer_units, self.streamed, strict=True) if not s]

    def permanent_bytes(self) -> int:
        if self.plan.lifetime is Lifetime.PERMANENT:
            return sum(u.nbytes for u in self._resident_units())
        return 0

    def transient_bytes(self) -> int:
        assert self.rest is not None and self.streamer is not None
        streamed = sorted((u.nbytes for u, s in zip(self.layer_units, self.streamed, strict=True) if s), reverse=True)
        window = sum(streamed[: self.streamer.depth + 1])
        forward_resident = (
            0 if self.plan.lifetime is Lifetime.PERMANENT else sum(u.nbytes for u in self._resident_units())
        )
        return self.rest.nbytes + forward_resident + window

    # -- lifecycle ------------------------------------------------------------------------------

    def setup(self) -> None:
        assert self.rest is not None and self.streamer is not None
        self.rest.capture()
        for unit in self.layer_units:
            unit.capture()
        if self.plan.lifetime is Lifetime.PERMANENT:
            for unit in self._resident_units():
                unit.load()
        self.add_guards()
        self.register(self.module, StartHook(self.streamer), START_HOOK)
        for i, (_, _, layer) in enumerate(expand_layers(self.name, self.module, self.specs)):
            self.register(layer, LayerHook(self.streamer, i), LAYER_HOOK)

    def enter(self) -> None:
        assert self.rest is not None
        self.rest.load()
        if self.plan.lifetime is Lifetime.FORWARD:
            for unit in self._resident_units():
                unit.load()

    def exit(self) -> None:
        assert self.rest is not None and self.streamer is not None
        self.streamer.finish()
        if self.plan.lifetime is Lifetime.FORWARD:
            for unit in self._resident_units():
                unit.unload()
        self.rest.unload()

    def close(self) -> None:
        super().close()
        assert self.rest is not None
        for unit in [*self.layer_units, self.rest]:
            unit.restore()

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "layer_specs": list(self.specs),
            "num_layers": len(self.layer_units),
            "num_streamed": sum(self.streamed),
            "resident_layers": self.plan.resident_layers,
            "lifetime": self.plan.lifetime.value,
            "prefetch_size": self.plan.prefetch_size,
            "effective_prefetch": self.streamer.depth if self.streamer else None,
        }
