"""Per-row adapted Linear layers: one batched call in which every row applies its own adapters.

Each adapted Linear of the denoiser(s) gets a diffusers `ModelHook` (`LORA_HOOK`) that computes, per row b,

    y_b = W x_b + sum_i scale_bi * B_i (A_i x_b)

from the layer's stacked adapter slots (A: (slots, rank, in), B: (slots, out, rank), zero-padded to
`--max-lora-rank`, so every adapter has the same shape), in `lora/rows.py`: one shared slot's two matmuls, or each
row's slots gathered into two batched matmuls; a row that uses no adapter is left exactly as the base layer
computed it. Plain torch, so CPU and GPU share the path.

The slots are non-persistent buffers of the adapted Linear (`LORA_DOWN`, `LORA_UP`), so they follow their layer
wherever residency puts it: placed with a resident component, moved with an offloaded one, streamed with their
block under layer-wise offload, and counted in the transfer ledger with the layer's weights. Under tensor parallel
`lora/sharding.py` cuts them like the base weight; compiled code takes the fixed-shape path (`rows.add_dense`).

Which rows use which slots is per denoiser call: the recipe sets it for the denoise of a batch, or for each step of
a continuous group (`LoraBank.rows`), one entry per output row; a request's rows share its adapters, a doubled
batch (batched CFG) repeats the assignment for each half, and a block that a step cache narrows to the rows that
compute narrows the assignment with it. The hooks read it from the call in progress (`runtime/row_context.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from diffuserve.errors import ConfigError
from diffuserve.lora.files import LoraAdapter
from diffuserve.lora.rows import RowPlan, add_dense, add_rows, dense_scales, plan_rows
from diffuserve.runtime import row_context
from diffuserve.runtime.row_context import RowView

LORA_HOOK = "diffuserve_lora"
"""The name of the per-row adapter hook in each adapted layer's diffusers `HookRegistry`."""
LORA_DOWN = "diffuserve_lora_down"
"""The buffer of an adapted Linear holding its stacked A slots, (slots, max_rank, in_features)."""
LORA_UP = "diffuserve_lora_up"
"""The buffer of an adapted Linear holding its stacked B slots, (slots, out_features, max_rank), alpha / rank in."""


class RowAssignment:
    """One denoiser call's rows -> (slot, scale) pairs, with its index tensors per row count (`lora/rows.py`) and
    its fixed-shape scales for compiled code (`rows.dense_scales`). The call's `adapters` (`runtime/row_context.py`)."""

    def __init__(
        self, rows: Sequence[Sequence[tuple[int, float]]], shape: tuple[int, int, torch.device, torch.dtype]
    ) -> None:
        self.rows = [list(r) for r in rows]
        self.shape = shape
        """(slots, max rank, device, dtype) of the bank's slots."""
        self.dense = dense_scales(self.rows, *shape)
        """The scales per row and slot that compiled code reads (made here, outside compiled code)."""
        self._plans: dict[tuple[int, str], RowPlan | None] = {}
        self._narrowed: dict[RowView, RowAssignment] = {}

    def plan(self, total: int, rank: int, device: torch.device, dtype: torch.dtype) -> RowPlan | None:
        """The index and scale tensors of a call of `total` rows, built once per assignment."""
        key = (total, f"{device}:{dtype}:{rank}")
        if key not in self._plans:
            self._plans[key] = plan_rows(self.rows, total, rank, device, dtype)
        return self._plans[key]

    def narrowed(self, view: RowView) -> RowAssignment:
        """The assignment of the rows `view` keeps of a call of `view.full` rows (this assignment repeated when the
        call doubles the batch)."""
        found = self._narrowed.get(view)
        if found is None:
            n = len(self.rows)
            if view.full % n:
                raise RuntimeError(f"a call of {view.full} rows was narrowed but the batch assigned adapters to {n}")
            if len(self._narrowed) >= 64:  # the computing rows vary from step to step
                self._narrowed.clear()
            found = self._narrowed[view] = RowAssignment([self.rows[r % n] for r in view.rows], self.shape)
        return found


def current_adapters() -> RowAssignment | None:
    """The adapters of the rows of the call in progress (None: no row uses one)."""
    call = row_context.current()
    return None if call is None else call.adapters


def _lora_hook_class() -> type:
    from diffusers.hooks import ModelHook

    class LoraRowsHook(ModelHook):
        """`y = base(x)`, plus each row's adapters from the layer's slots (see the module docstring)."""

        def __init__(self, bank: LoraBank, layer: torch.nn.Module) -> None:
            super().__init__()
            self.bank = bank
            self.layer = layer
            """The adapted Linear, which holds the slots as buffers (`LORA_DOWN`, `LORA_UP`)."""
            self.parallel: Any = None
            """Under tensor parallel: the sum on the local shards (`lora/sharding.py`); None: the plain path."""

        @property
        def down(self) -> torch.Tensor:
            """(slots, max_rank, in_features); zero for slots whose adapter does not adapt this layer."""
            return self.layer._buffers[LORA_DOWN]

        @property
        def up(self) -> torch.Tensor:
            """(slots, out_features, max_rank), with each adapter's alpha / rank folded in."""
            return self.layer._buffers[LORA_UP]

        def new_forward(self, module: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            y = self.fn_ref.original_forward(x, *args, **kwargs)
            if self.parallel is not None:
                return self.parallel(self, y, x)
            assignment = current_adapters()
            if torch.compiler.is_compiling():  # fixed shapes, scales as data: a new adapter mix does not recompile
                return y if assignment is None else add_dense(y, x, self.down, self.up, assignment.dense)
            if assignment is None:
                return y
            down, up = self.down, self.up
            if down.device != x.device:  # a layer moved outside the residency manager: its slots follow
                module._buffers[LORA_DOWN] = down = down.to(x.device)
                module._buffers[LORA_UP] = up = up.to(x.device)
            if down.dtype != x.dtype:
                down, up = down.to(x.dtype), up.to(x.dtype)
            plan = assignment.plan(x.shape[0], down.shape[1], x.device, x.dtype)
            if plan is None:
                return y
            return add_rows(y, x, down, up, plan, self.bank.adapted(self))

    return LoraRowsHook


class LoraBank:
    """The adapters in per-layer slots of the denoiser(s); which rows use them is the call's (`rows`)."""

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
        if isinstance(denoisers, torch.nn.Module):
            denoisers = {"transformer": denoisers}
        self.slots: dict[str, int] = {a.name: i for i, a in enumerate(adapters)}
        """Adapter name -> its slot in every adapted layer."""
        self._shape = (max_loras, max_rank, torch.device(device), dtype)
        self._lock = threading.Lock()
        self._adapted: dict[int, set[int]] = {}
        self._assignments: dict[tuple[tuple[tuple[str, float], ...], ...], RowAssignment] = {}
        """Recent row assignments by their rows: a continuous group keeps its rows for many steps."""
        self._layers = {key: dict(model.named_modules()) for key, model in denoisers.items()}
        self.hooks: dict[tuple[str, str], Any] = {}
        """(denoiser, adapted module name) -> its hook (`place` writes slots through these)."""
        for denoiser, module in sorted({(a.denoiser, m) for a in adapters for m in a.modules}):
            hook = self._hook((denoiser, module))
            for slot, adapter in enumerate(adapters):
                if adapter.denoiser == denoiser and module in adapter.modules:
                    self._write(hook, slot, adapter.modules[module])
        self.layers = len(self.hooks)
        """How many Linear layers carry the hook."""

    @property
    def nbytes(self) -> int:
        """Bytes of all slots (whole, before tensor parallel cuts them): what the DiT holds beyond its weights."""
        return sum(t.numel() * t.element_size() for h in self.hooks.values() for t in (h.down, h.up))

    def _hook(self, key: tuple[str, str]) -> Any:
        """Empty slots on layer `key` (its buffers) and its hook."""
        from diffusers.hooks import HookRegistry

        max_loras, max_rank, device, dtype = self._shape
        layer = self._layers[key[0]][key[1]]
        layer.register_buffer(
            LORA_DOWN, torch.zeros(max_loras, max_rank, layer.in_features, device=device, dtype=dtype), False
        )
        layer.register_buffer(
            LORA_UP, torch.zeros(max_loras, layer.out_features, max_rank, device=device, dtype=dtype), False
        )
        hook = _lora_hook_class()(self, layer)
        self._adapted[id(hook)] = set()
        HookRegistry.check_if_exists_or_initialize(layer).register_hook(hook, LORA_HOOK)
        self.hooks[key] = hook
        return hook

    def _write(self, hook: Any, slot: int, part: Any) -> None:
        rank = part.down.shape[0]
        down, up = hook.down, hook.up
        down[slot].zero_()
        up[slot].zero_()
        down[slot, :rank] = part.down.to(down.device, down.dtype)
        up[slot, :, :rank] = (part.up.float() * part.scaling).to(up.device, up.dtype)
        self._adapted[id(hook)].add(slot)

    def place(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write `adapter` into `slot` of every adapted layer (None: empty the slot), hooking the layers it adapts
        that no adapter adapted before. Runtime loads go through this; call it between calls, on the thread that
        runs them (never while a call's rows are set)."""
        self._assignments.clear()  # they hold slot numbers, which may now name another adapter
        modules = {(adapter.denoiser, m): part for m, part in adapter.modules.items()} if adapter is not None else {}
        for key in sorted(set(modules) - set(self.hooks)):
            self._hook(key)
        self.layers = len(self.hooks)
        for key, hook in self.hooks.items():
            part = modules.get(key)
            if part is not None:
                self._write(hook, slot, part)
            elif slot in self._adapted[id(hook)]:
                # Zeroed, not only marked: the batched paths (`rows.add_rows` gathering several slots, the compiled
                # dense path) read every slot a row uses, so the previous adapter's weights must not stay there.
                hook.down[slot].zero_()
                hook.up[slot].zero_()
                self._adapted[id(hook)].discard(slot)

    def adapted(self, hook: Any) -> set[int]:
        """The slots whose adapter adapts `hook`'s layer (the others are zero there)."""
        return self._adapted[id(hook)]

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

    def assignment(self, loras: Sequence[Sequence[tuple[str, float]]]) -> RowAssignment:
        """The row assignment of `loras`, reused while the same rows come back (a continuous group's steps)."""
        key = tuple(tuple((name, float(scale)) for name, scale in row) for row in loras)
        found = self._assignments.get(key)
        if found is None:
            if len(self._assignments) >= 16:  # a few groups alive at once; older ones are gone
                self._assignments.clear()
            found = self._assignments[key] = RowAssignment(self.slot_rows(loras), self._shape)
        return found

    @contextmanager
    def rows(self, loras: Sequence[Sequence[tuple[str, float]]]) -> Iterator[None]:
        """Within: the adapted layers apply row r's adapters `loras[r]` ((name, scale) pairs), one entry per row
        of the denoiser call (a dynamic batch, or the rows of one continuous step): the call's `adapters`
        (`runtime/row_context.py`). One call at a time."""
        if not any(loras):
            yield
            return
        with self._lock, row_context.with_parts(adapters=self.assignment(loras)):
            yield
