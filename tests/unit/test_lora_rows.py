"""The per-row adapter sum's two paths (`lora/rows.py`): one shared slot (no gather) and gathered slots (batched
matmuls), each equal to the per-row reference, a row in a batch equal to the same row alone, and the slots held
as buffers of the adapted Linear (so residency moves them with it)."""

from __future__ import annotations

import pytest
import torch

from diffuserve.lora.files import LoraAdapter, LoraModule
from diffuserve.lora.layers import LORA_DOWN, LORA_UP, LoraBank, current_adapters
from diffuserve.lora.rows import add_dense


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.other = torch.nn.Linear(6, 6)


def _adapter(name: str, rank: int, seed: int, modules: tuple[str, ...] = ("proj",)) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    parts = {
        m: LoraModule(
            torch.randn(rank, 6, generator=gen), torch.randn(5 if m == "proj" else 6, rank, generator=gen), 0.5
        )
        for m in modules
    }
    return LoraAdapter(name, "mem", parts)


def _reference(model: _Tiny, adapters: dict[str, LoraAdapter], x: torch.Tensor, rows) -> torch.Tensor:
    """Row by row: the base layer plus each of the row's adapters, computed in float64."""
    w, b = model.proj.weight.double(), model.proj.bias.double()
    out = []
    for xi, pairs in zip(x.double(), rows, strict=True):
        y = xi @ w.T + b
        for name, scale in pairs:
            m = adapters[name].modules.get("proj")
            if m is not None:
                y = y + scale * m.scaling * (xi @ m.down.double().T @ m.up.double().T)
        out.append(y)
    return torch.stack(out).float()


@pytest.mark.parametrize(
    "rows",
    [
        [[("a", 1.0)], [("a", -0.5)], [("a", 2.0)]],  # one shared slot, every row: no gather at all
        [[("a", 1.0)], [], [("a", 0.25)]],  # one shared slot, some rows
        [[("a", 1.0)], [("b", 0.5)], [("c", 1.5)]],  # a slot per row, every row
        [[("b", 1.0), ("a", 0.5)], [("c", -1.0)], []],  # several per row (padded), a bare row
    ],
)
def test_both_paths_equal_the_per_row_reference_and_each_row_alone(rows) -> None:
    torch.manual_seed(0)
    model = _Tiny()
    adapters = {n: _adapter(n, r, s) for n, r, s in (("a", 2, 1), ("b", 4, 2), ("c", 3, 3))}
    adapters["d"] = _adapter("d", 2, 4, modules=("other",))  # adapts another layer only
    bank = LoraBank(model, list(adapters.values()), max_loras=4, max_rank=4, device="cpu", dtype=torch.float32)
    x = torch.randn(3, 7, 6)
    with bank.rows(rows):
        batched = model.proj(x)
    assert torch.allclose(batched, _reference(model, adapters, x, rows), atol=1e-5)
    for i, pairs in enumerate(rows):
        with bank.rows([pairs]):
            alone = model.proj(x[i : i + 1])
        assert torch.allclose(batched[i], alone[0], atol=1e-6), i
        if not pairs:
            assert torch.equal(batched[i], torch.nn.functional.linear(x[i], model.proj.weight, model.proj.bias))
    with bank.rows(rows):  # the compiled form (every slot, scales as data) gives the same sums, CFG-doubled too
        base = torch.nn.functional.linear(torch.cat([x, x]), model.proj.weight, model.proj.bias)
        scales = current_adapters().dense
        dense = add_dense(base, torch.cat([x, x]), model.proj._buffers[LORA_DOWN], model.proj._buffers[LORA_UP], scales)
    assert torch.allclose(dense, torch.cat([batched, batched]), atol=1e-5)
    with bank.rows([[("d", 1.0)]] * 3):  # no row's adapter adapts `proj`: the base layer, exactly
        assert torch.equal(model.proj(x), torch.nn.functional.linear(x, model.proj.weight, model.proj.bias))


def test_the_slots_are_buffers_of_the_layer_and_move_with_it() -> None:
    model = _Tiny()
    LoraBank(model, [_adapter("a", 2, 1)], max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    buffers = dict(model.proj.named_buffers())
    assert buffers[LORA_DOWN].shape == (2, 4, 6) and buffers[LORA_UP].shape == (2, 5, 4)
    assert LORA_DOWN not in model.state_dict() and "proj." + LORA_DOWN not in model.state_dict()  # not persistent
    model.to(torch.float64)
    assert model.proj._buffers[LORA_DOWN].dtype == torch.float64
