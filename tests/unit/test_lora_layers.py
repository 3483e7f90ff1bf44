"""The per-row adapted layer on a bare Linear: each row gets exactly its own adapters' sum, a row without
adapters exactly the base layer; and the LoRA flags' start-up checks."""

from __future__ import annotations

import pytest
import torch

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import ConfigError
from diffuserve.lora.files import LoraAdapter, LoraModule
from diffuserve.lora.layers import LoraBank


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)


def _adapter(name: str, rank: int, scaling: float, seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    return LoraAdapter(
        name,
        "mem",
        {"proj": LoraModule(torch.randn(rank, 6, generator=gen), torch.randn(5, rank, generator=gen), scaling)},
    )


def test_each_row_gets_its_own_adapters_and_a_bare_row_the_base_layer() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    adapters = [_adapter("a", 2, 1.0, 1), _adapter("b", 3, 0.5, 2)]
    base = torch.nn.Linear(6, 5)
    base.load_state_dict(model.proj.state_dict())
    bank = LoraBank(model, adapters, max_loras=3, max_rank=4, device="cpu", dtype=torch.float32)
    x = torch.randn(3, 7, 6)
    rows = [[("a", 1.0)], [], [("a", -0.5), ("b", 2.0)]]

    def delta(adapter: LoraAdapter, xs: torch.Tensor) -> torch.Tensor:
        m = adapter.modules["proj"]
        return xs @ m.down.T @ m.up.T * m.scaling

    with bank.rows(rows):
        y = model.proj(x)
        doubled = model.proj(torch.cat([x, x]))  # batched CFG: the assignment repeats for each half
    want = base(x)
    want[0] += delta(adapters[0], x[0])
    want[2] += -0.5 * delta(adapters[0], x[2]) + 2.0 * delta(adapters[1], x[2])
    assert torch.allclose(y, want, atol=1e-5)
    assert torch.equal(y[1], base(x)[1])
    assert torch.allclose(doubled, torch.cat([y, y]), atol=1e-6)
    assert torch.equal(model.proj(x), base(x))  # outside a batch's scope: the base layer


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x))


def test_an_adapter_placed_over_another_leaves_nothing_of_it_in_the_layers_it_does_not_adapt() -> None:
    """A runtime swap (`place`) over a slot whose old adapter adapted more layers: the batched path gathers every
    slot a row uses in every adapted layer, so the old adapter's weights must be gone, not only unmarked."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)

    def adapter(name: str, modules: tuple[str, ...]) -> LoraAdapter:
        widths = {"proj": (6, 5), "out": (5, 5)}
        return LoraAdapter(
            name,
            "mem",
            {
                m: LoraModule(
                    torch.randn(2, widths[m][0], generator=gen), torch.randn(widths[m][1], 2, generator=gen), 1.0
                )
                for m in modules
            },
        )

    wide, other, narrow = (
        adapter("wide", ("proj", "out")),
        adapter("other", ("proj", "out")),
        adapter("narrow", ("proj",)),
    )
    model = _Two()
    bank = LoraBank(model, [wide, other], max_loras=2, max_rank=2, device="cpu", dtype=torch.float32)
    bank.place(0, narrow)  # into wide's slot: `out` no longer adapted there
    bank.slots = {"narrow": 0, "other": 1}
    x = torch.randn(2, 3, 6)
    with bank.rows([[("narrow", 1.0)], [("other", 1.0)]]):  # two slots: the gathered (bmm) path
        mixed = model(x)
    fresh = _Two()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items()})
    alone = LoraBank(fresh, [narrow], max_loras=1, max_rank=2, device="cpu", dtype=torch.float32)
    with alone.rows([[("narrow", 1.0)]]):
        want = fresh(x[:1])
    assert torch.allclose(mixed[:1], want, atol=1e-5), float((mixed[:1] - want).abs().max())


def test_more_adapters_than_slots_is_refused() -> None:
    with pytest.raises(ConfigError, match="--max-loras"):
        LoraBank(
            _Tiny(),
            [_adapter("a", 2, 1.0, 1), _adapter("b", 2, 1.0, 2)],
            max_loras=1,
            max_rank=2,
            device="cpu",
            dtype=torch.float32,
        )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"lora_modules": ["style"]}, "--lora-modules: 'style' is not NAME=PATH"),
        ({"lora_modules": ["a=/x", "a=/y"]}, "given twice"),
        ({"lora_modules": ["x=nope"]}, "--lora-modules: x=nope: 'nope' does not exist; give an adapter folder"),
        ({"lora_modules": ["x=transformer_2:/no/such"]}, "--lora-modules: x=transformer_2:/no/such: '/no/such' does"),
        ({"lora_modules": ["x=/"]}, "'/' is a folder without a .safetensors file"),
        ({"max_loras": 0}, "--max-loras"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "--max-cpu-loras: 2 is below --max-loras 4"),
        ({"enable_lora_updates": True}, "--lora-root"),
        ({"enable_lora_updates": True, "lora_root": "/no/such/folder"}, "--lora-root: '/no/such/folder' is not"),
        ({"max_lora_rank": 0}, "--max-lora-rank"),
        (
            {"enable_lora_updates": True, "lora_root": "/", "api_process": "separate"},
            "--enable-lora-updates: runtime adapter loads need the engine in the HTTP process",
        ),
    ],
)
def test_lora_flags_are_checked_at_start_up(flags: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ServerArgs(**flags).validate()
