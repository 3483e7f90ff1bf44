"""Per-row adapted Linear layers: one batched call in which every row applies its own adapters.

Each adapted Linear of the transformer gets a diffusers `ModelHook` (`LORA_HOOK`) that computes, per row b,

    y_b = W x_b + sum_i scale_bi * B_i (A_i x_b)

from the layer's stacked adapter slots (A: (slots, rank, in), B: (slots, out, rank), zero-padded to
`--max-lora-rank`, so every adapter has the same shape). The sum is segmented by slot: the rows that use slot s are
gathered, pass through A_s then B_s, and are added back scaled; a row that uses no adapter is left exactly as the
base layer computed it. Plain torch, so CPU and GPU share the path.

Which rows use which slots is per batch: the recipe sets it for the denoise of a batch (`LoraBank.rows`), one
entry per output row; a request's rows share its adapters, and a doubled batch (batched CFG) repeats the
assignment for each half.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from diffuserve.errors import ConfigError
from diffuserve.lora.files import LoraAdapter
from diffuserve.runtime.row_view import RowView, current_view

LORA_HOOK = "diffuserve_lora"
"""The name of the per-row adapter hook in each adapted layer's diffusers `HookRegistry`."""

Groups = list[tuple[int, torch.Tensor, torch.Tensor]]
"""(slot, row indices, per-row scales) for each slot some row uses."""


class _RowAssignment:
    """The current batch's rows -> (slot, scale) pairs, with the segmented groups per row count."""

    def __init__(self, rows: Sequence[Sequence[tuple[int, float]]]) -> None:
        self.rows = [list(r) for r in rows]
        self._groups: dict[tuple[int, str, RowView | None], Groups] = {}

    def groups(self, total: int, device: torch.device, dtype: torch.dtype) -> Groups:
        """The groups for a call of `total` rows: the assignment repeated when the batch is doubled (CFG), and
        narrowed to the rows a step cache runs (`runtime/row_view.py`)."""
        view = current_view()
        if view is not None and view.full == total:
            view = None  # not narrowed
        key = (total, f"{device}:{dtype}", view)
        if key not in self._groups:
            if len(self._groups) >= 64:  # narrowed views vary from step to step; old ones are not coming back
                self._groups.clear()
            n = len(self.rows)
            full = view.full if view is not None else total
            if full % n or (view is not None and len(view.rows) != total):
                raise RuntimeError(f"an adapted layer got {total} rows but the batch assigned adapters to {n}")
            per_slot: dict[int, tuple[list[int], list[float]]] = {}
            for position, row in enumerate(view.rows if view is not None else range(full)):
                for slot, scale in self.rows[row % n]:
                    idx, scales = per_slot.setdefault(slot, ([], []))
                    idx.append(position)
                    scales.append(scale)
            self._groups[key] = [
                (slot, torch.tensor(idx, device=device), torch.tensor(scales, device=device, dtype=dtype))
                for slot, (idx, scales) in sorted(per_slot.items())
            ]
        return self._groups[key]


def _lora_hook_class() -> type:
    from diffusers.hooks import ModelHook

    class LoraRowsHook(ModelHook):
        """`y = base(x)`, plus each row's adapters from the layer's slots (see the module docstring)."""

        def __init__(self, bank: LoraBank, down: torch.Tensor, up: torch.Tensor) -> None:
            super().__init__()
            self.bank = bank
            self.down = down
            """(slots, max_rank, in_features); zero for slots whose adapter does not adapt this layer."""
            self.up = up
            """(slots, out_features, max_rank), with each adapter's alpha / rank folded in."""

        def new_forward(self, module: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            y = self.fn_ref.original_forward(x, *args, **kwargs)
            assignment = self.bank.current
            if assignment is None:
                return y
            if self.down.device != x.device or self.down.dtype != x.dtype:  # the layer moved (offload)
                self.down, self.up = self.down.to(x.device, x.dtype), self.up.to(x.device, x.dtype)
            view = (-1,) + (1,) * (x.dim() - 1)
            for slot, idx, scales in assignment.groups(x.shape[0], x.device, x.dtype):
                if not self.bank.adapts(slot, self):
                    continue
                part = torch.nn.functional.linear(x.index_select(0, idx), self.down[slot])
                part = torch.nn.functional.linear(part, self.up[slot]) * scales.view(view)
                y.index_add_(0, idx, part)  # in place: `y` is the base layer's own fresh output
            return y

    return LoraRowsHook


class LoraBank:
    """The adapters loaded at start-up, in per-layer slots of the denoiser(s), and the current batch's rows."""

    def __init__(
        self,
        denoisers: torch.nn.Module | dict[str, torch.nn.Module],
        adapters: Sequence[LoraAdapter],
        *,
        max_loras: int,
        max_rank: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if len(adapters) > max_loras:
            raise ConfigError(
                f"--lora-modules: {len(adapters)} adapters but --max-loras {max_loras}; raise "
                "--max-loras (adapters on the device at once) or load fewer."
            )
        from diffusers.hooks import HookRegistry

        if isinstance(denoisers, torch.nn.Module):
            denoisers = {"transformer": denoisers}
        self.slots: dict[str, int] = {a.name: i for i, a in enumerate(adapters)}
        """Adapter name -> its slot in every adapted layer."""
        self.current: _RowAssignment | None = None
        """The rows of the batch being denoised; None: no row uses an adapter (every layer is the base layer)."""
        self._lock = threading.Lock()
        self._adapted: dict[int, set[int]] = {}
        self._assignments: dict[tuple[tuple[tuple[str, float], ...], ...], _RowAssignment] = {}
        """Recent row assignments by their rows: a continuous group keeps its rows for many steps."""
        self._layers = {key: dict(model.named_modules()) for key, model in denoisers.items()}
        self._geometry = (max_loras, max_rank, device, dtype)
        self.hooks: dict[tuple[str, str], Any] = {}
        """(denoiser, adapted module name) -> its hook (`place` writes slots through these)."""
        hook_class = _lora_hook_class()
        targets = sorted({(a.denoiser, m) for a in adapters for m in a.modules})
        for denoiser, module in targets:
            layer = self._layers[denoiser][module]
            mine = [
                (slot, a.modules[module])
                for slot, a in enumerate(adapters)
                if a.denoiser == denoiser and module in a.modules
            ]
            down = torch.zeros(max_loras, max_rank, layer.in_features, device=device, dtype=dtype)
            up = torch.zeros(max_loras, layer.out_features, max_rank, device=device, dtype=dtype)
            for slot, part in mine:
                rank = part.down.shape[0]
                down[slot, :rank] = part.down.to(device, dtype)
                up[slot, :, :rank] = (part.up.float() * part.scaling).to(device, dtype)
            hook = hook_class(self, down, up)
            self._adapted[id(hook)] = {slot for slot, _ in mine}
            HookRegistry.check_if_exists_or_initialize(layer).register_hook(hook, LORA_HOOK)
            self.hooks[(denoiser, module)] = hook
        self.layers = len(targets)
        """How many Linear layers carry the hook."""

    def place(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write `adapter` into `slot` of every adapted layer (None: empty the slot), hooking the layers it adapts
        that no adapter adapted before. Runtime loads go through this; call it between batches, on the thread
        that runs them (never while a batch's rows are set)."""
        from diffusers.hooks import HookRegistry

        max_loras, max_rank, device, dtype = self._geometry
        self._assignments.clear()  # they hold slot numbers, which may now name another adapter
        modules = {(adapter.denoiser, m): part for m, part in adapter.modules.items()} if adapter is not None else {}
        for key in sorted(set(modules) - set(self.hooks)):
            denoiser, module = key
            layer = self._layers[denoiser][module]
            down = torch.zeros(max_loras, max_rank, layer.in_features, device=device, dtype=dtype)
            up = torch.zeros(max_loras, layer.out_features, max_rank, device=device, dtype=dtype)
            hook = _lora_hook_class()(self, down, up)
            self._adapted[id(hook)] = set()
            HookRegistry.check_if_exists_or_initialize(layer).register_hook(hook, LORA_HOOK)
            self.hooks[key] = hook
        self.layers = len(self.hooks)
        for key, hook in self.hooks.items():
            part = modules.get(key)
            adapted = self._adapted[id(hook)]
            if part is None:
                adapted.discard(slot)  # the hook skips the slot: no need to zero it
                continue
            rank = part.down.shape[0]
            hook.down[slot].zero_()
            hook.up[slot].zero_()
            hook.down[slot, :rank] = part.down.to(hook.down.device, hook.down.dtype)
            hook.up[slot, :, :rank] = (part.up.float() * part.scaling).to(hook.up.device, hook.up.dtype)
            adapted.add(slot)

    def adapts(self, slot: int, hook: Any) -> bool:
        return slot in self._adapted[id(hook)]

    def slot_rows(self, loras: Sequence[Sequence[tuple[str, float]]]) -> list[list[tuple[int, float]]]:
        """Per row, its (slot, scale) pairs; an unknown name fails naming it (the server refuses it earlier)."""
        out: list[list[tuple[int, float]]] = []
        for row in loras:
            pairs: list[tuple[int, float]] = []
            for name, scale in row:
                if name not in self.slots:
                    raise ValueError(f"lora: no adapter named {name!r} is loaded (loaded: {sorted(self.slots)})")
                pairs.append((self.slots[name], float(scale)))
            out.append(pairs)
        return out

    def assignment(self, loras: Sequence[Sequence[tuple[str, float]]]) -> _RowAssignment:
        """The row assignment of `loras`, reused while the same rows come back (a continuous group's steps)."""
        key = tuple(tuple((name, float(scale)) for name, scale in row) for row in loras)
        found = self._assignments.get(key)
        if found is None:
            if len(self._assignments) >= 16:  # a few groups alive at once; older ones are gone
                self._assignments.clear()
            found = self._assignments[key] = _RowAssignment(self.slot_rows(loras))
        return found

    @contextmanager
    def rows(self, loras: Sequence[Sequence[tuple[str, float]]]) -> Iterator[None]:
        """Within: the adapted layers apply row r's adapters `loras[r]` ((name, scale) pairs), one entry per row
        of the denoiser call (a dynamic batch, or the rows of one continuous step). One call at a time."""
        if not any(loras):
            yield
            return
        assignment = self.assignment(loras)
        with self._lock:
            self.current = assignment
            try:
                yield
            finally:
                self.current = None


def install_lora(
    pipeline: Any,
    family: str,
    adapters: dict[str, str],
    *,
    max_loras: int,
    max_rank: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> LoraBank | None:
    """Read `adapters` (name -> path) through diffusers, check them against the pipeline's denoiser(s), and hook
    their adapted layers; the pipeline's recipe then sets each call's rows (`RecipePipeline.use_lora`). On the
    diffusers backend the pipeline loads them itself and runs one adapter set per call (None: no bank)."""
    from diffuserve.lora.files import read_adapter, split_target

    if not hasattr(pipeline, "use_lora"):
        if not hasattr(pipeline, "load_lora_adapters"):
            raise ConfigError(f"--lora-modules: this {family} pipeline takes no LoRA adapters.")
        pipeline.load_lora_adapters(adapters)  # the diffusers backend: one adapter set per call
        return None
    denoisers = tuple(getattr(pipeline, "denoisers", ("transformer",)))
    models = {key: pipeline.components[key] for key in denoisers}
    loaded = []
    for name, spec in adapters.items():
        denoiser, path = split_target(spec, denoisers)
        loaded.append(read_adapter(name, path, family, models[denoiser], max_rank=max_rank, denoiser=denoiser))
    bank = LoraBank(models, loaded, max_loras=max_loras, max_rank=max_rank, device=device, dtype=dtype)
    pipeline.use_lora(bank)
    return bank
