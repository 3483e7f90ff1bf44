"""Per-row adapted Linear layers: one batched call in which every row applies its own adapters.

Each adapted Linear of the transformer gets a diffusers `ModelHook` (`LORA_HOOK`) that computes, per row b,

    y_b = W x_b + sum_i scale_bi * B_i (A_i x_b)

from the layer's stacked adapter slots (A: (slots, rank, in), B: (slots, out, rank), zero-padded to
`--max-lora-rank`, so every adapter has the same shape), in `lora/rows.py`: one shared slot's two matmuls, or each
row's slots gathered into two batched matmuls; a row that uses no adapter is left exactly as the base layer
computed it. Plain torch, so CPU and GPU share the path.

The slots are non-persistent buffers of the adapted Linear (`LORA_DOWN`, `LORA_UP`), so they follow their layer
wherever residency puts it: placed with a resident component, moved with an offloaded one, streamed with their
block under layer-wise offload, and counted in the transfer ledger with the layer's weights. Under tensor parallel
`lora/sharding.py` cuts them like the base weight; compiled code takes the fixed-shape path (`rows.add_dense`).

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
from diffuserve.lora.rows import RowPlan, add_dense, add_rows, dense_scales, plan_rows

LORA_HOOK = "diffuserve_lora"
"""The name of the per-row adapter hook in each adapted layer's diffusers `HookRegistry`."""
LORA_DOWN = "diffuserve_lora_down"
"""The buffer of an adapted Linear holding its stacked A slots, (slots, max_rank, in_features)."""
LORA_UP = "diffuserve_lora_up"
"""The buffer of an adapted Linear holding its stacked B slots, (slots, out_features, max_rank), alpha / rank in."""

Groups = list[tuple[int, torch.Tensor, torch.Tensor]]
"""(slot, row indices, per-row scales) for each slot some row uses."""


class _RowAssignment:
    """The current batch's rows -> (slot, scale) pairs, with the segmented groups per row count."""

    def __init__(self, rows: Sequence[Sequence[tuple[int, float]]]) -> None:
        self.rows = [list(r) for r in rows]
        self._groups: dict[tuple[int, str], Groups] = {}
        self._plans: dict[tuple[int, str], RowPlan | None] = {}

    def groups(self, total: int, device: torch.device, dtype: torch.dtype) -> Groups:
        """The groups for a call of `total` rows: the assignment repeated when the batch is doubled (CFG)."""
        key = (total, f"{device}:{dtype}")
        if key not in self._groups:
            n = len(self.rows)
            if total % n:
                raise RuntimeError(f"an adapted layer got {total} rows but the batch assigned adapters to {n}")
            per_slot: dict[int, tuple[list[int], list[float]]] = {}
            for copy in range(total // n):
                for row, pairs in enumerate(self.rows):
                    for slot, scale in pairs:
                        idx, scales = per_slot.setdefault(slot, ([], []))
                        idx.append(copy * n + row)
                        scales.append(scale)
            self._groups[key] = [
                (slot, torch.tensor(idx, device=device), torch.tensor(scales, device=device, dtype=dtype))
                for slot, (idx, scales) in sorted(per_slot.items())
            ]
        return self._groups[key]

    def plan(self, total: int, rank: int, device: torch.device, dtype: torch.dtype) -> RowPlan | None:
        """The index and scale tensors of a call of `total` rows (`lora/rows.py`), built once per batch."""
        key = (total, f"{device}:{dtype}:{rank}")
        if key not in self._plans:
            self._plans[key] = plan_rows(self.rows, total, rank, device, dtype)
        return self._plans[key]


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
            if torch.compiler.is_compiling():  # fixed shapes, scales as data: a new adapter mix does not recompile
                scales = self.bank.dense
                return y if scales is None else add_dense(y, x, self.down, self.up, scales)
            assignment = self.bank.current
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
    """The adapters loaded at start-up, in per-layer slots of the transformer, and the current batch's rows."""

    def __init__(
        self,
        transformer: torch.nn.Module,
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

        self.slots: dict[str, int] = {a.name: i for i, a in enumerate(adapters)}
        """Adapter name -> its slot in every adapted layer."""
        self.current: _RowAssignment | None = None
        """The rows of the batch being denoised; None: no row uses an adapter (every layer is the base layer)."""
        self.dense: torch.Tensor | None = None
        """The current batch's scales per row and slot (`rows.dense_scales`), which compiled code reads; None: none."""
        self._shape = (max_loras, max_rank, torch.device(device), dtype)
        self._lock = threading.Lock()
        self._adapted: dict[int, frozenset[int]] = {}
        layers = dict(transformer.named_modules())
        targets = sorted({m for a in adapters for m in a.modules})
        hook_class = _lora_hook_class()
        for module in targets:
            layer = layers[module]
            down = torch.zeros(max_loras, max_rank, layer.in_features, device=device, dtype=dtype)
            up = torch.zeros(max_loras, layer.out_features, max_rank, device=device, dtype=dtype)
            for slot, adapter in enumerate(adapters):
                part = adapter.modules.get(module)
                if part is None:
                    continue
                rank = part.down.shape[0]
                down[slot, :rank] = part.down.to(device, dtype)
                up[slot, :, :rank] = (part.up.float() * part.scaling).to(device, dtype)
            layer.register_buffer(LORA_DOWN, down, persistent=False)
            layer.register_buffer(LORA_UP, up, persistent=False)
            hook = hook_class(self, layer)
            self._adapted[id(hook)] = frozenset(s for s, a in enumerate(adapters) if module in a.modules)
            HookRegistry.check_if_exists_or_initialize(layer).register_hook(hook, LORA_HOOK)
        self.layers = len(targets)
        """How many Linear layers carry the hook."""
        self.nbytes = sum(
            layers[m]._buffers[k].numel() * layers[m]._buffers[k].element_size()
            for m in targets
            for k in (LORA_DOWN, LORA_UP)
        )
        """Bytes of all slots (whole, before tensor parallel cuts them): what the DiT holds beyond its weights."""

    def adapts(self, slot: int, hook: Any) -> bool:
        return slot in self._adapted[id(hook)]

    def adapted(self, hook: Any) -> frozenset[int]:
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

    @contextmanager
    def rows(self, loras: Sequence[Sequence[tuple[str, float]]]) -> Iterator[None]:
        """Within: the adapted layers apply row r's adapters `loras[r]` ((name, scale) pairs). One batch at a time."""
        if not any(loras):
            yield
            return
        assignment = _RowAssignment(self.slot_rows(loras))
        with self._lock:
            self.current = assignment
            self.dense = dense_scales(assignment.rows, *self._shape)
            try:
                yield
            finally:
                self.current = None
                self.dense = None


def install_lora(
    pipeline: Any,
    family: str,
    adapters: dict[str, str],
    *,
    max_loras: int,
    max_rank: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> LoraBank:
    """Read `adapters` (name -> path) through diffusers, check them against the pipeline's transformer, and hook
    its adapted layers; the pipeline's recipe then sets each batch's rows (`RecipePipeline.use_lora`)."""
    from diffuserve.lora.files import read_adapter

    if not hasattr(pipeline, "use_lora"):
        raise ConfigError(
            "--lora-modules: per-request LoRA needs the native backend (the diffusers backend does not "
            "take adapters yet); drop --backend diffusers."
        )
    transformer = pipeline.components["transformer"]
    loaded = [read_adapter(name, path, family, transformer, max_rank=max_rank) for name, path in adapters.items()]
    bank = LoraBank(transformer, loaded, max_loras=max_loras, max_rank=max_rank, device=device, dtype=dtype)
    pipeline.use_lora(bank)
    return bank
