"""Per-request LoRA under residency: an adapter's slots are buffers of its layer, so they stream with the block
under layer-wise offload and move with an offloaded component; the outputs equal the resident run (<= 1/255; on
CPU the very same tensors are re-attached, so 0) and the transfer ledger counts the adapter bytes with each layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def adapters(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from diffuserve.lora.tiny import write_random_lora

    root = tmp_path_factory.mktemp("loras-residency")
    return {
        "style": str(write_random_lora(tiny_flux_path, root / "style", rank=4, seed=1)),
        "mlp": str(write_random_lora(tiny_flux_path, root / "mlp", rank=2, seed=3, targets=("to_q", "proj_mlp"))),
    }


def _pipeline(path: Path, adapters: dict[str, str]):
    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(path)
    install_lora(pipe, "flux", adapters, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    return pipe


def _batch() -> list[SamplingParams]:
    common = {"num_inference_steps": 3, "width": 64, "height": 64}
    return [
        SamplingParams(prompt="a red house", seed=1, lora=(("style", 1.0),), **common),
        SamplingParams(prompt="a dog", seed=2, **common),
        SamplingParams(prompt="sea at night", seed=3, lora=(("style", 0.5), ("mlp", 1.5)), n=2, **common),
    ]


def _pixels(pipe) -> np.ndarray:
    with torch.inference_mode():
        return np.stack([np.asarray(o.images[0]).astype(np.int16) for o in pipe.run(_batch()).outputs])


def _lora_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for n, b in module.named_buffers() if "diffuserve_lora" in n)


@pytest.fixture(scope="module")
def resident(tiny_flux_path, adapters) -> np.ndarray:
    return _pixels(_pipeline(tiny_flux_path, adapters))


@pytest.mark.parametrize("mode", ["layerwise-offload", "component-offload"])
def test_adapter_slots_follow_their_layer_and_the_ledger_counts_them(tiny_flux_path, adapters, resident, mode) -> None:
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    pipe = _pipeline(tiny_flux_path, adapters)
    transformer = pipe.components["transformer"]
    layers = {f"transformer_blocks.{i}": b for i, b in enumerate(transformer.transformer_blocks)}
    layers |= {f"single_transformer_blocks.{i}": b for i, b in enumerate(transformer.single_transformer_blocks)}
    # What each block moves: its weights and its adapter slots (read before residency detaches them).
    want = {
        name: (sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())), _lora_bytes(b))
        for name, b in layers.items()
    }
    assert all(lora > 0 for _, lora in want.values())
    assert pipe.lora.nbytes == _lora_bytes(transformer)  # what the start-up log line reports
    whole = sum(t.numel() * t.element_size() for t in (*transformer.parameters(), *transformer.buffers()))
    modes = {
        key: ResidencyMode(mode) if key == "transformer" else ResidencyMode.COMPONENT_OFFLOAD for key in pipe.components
    }
    plan = DeploymentPlan(
        components={
            k: ComponentPlan(name=k, group="dit" if k == "transformer" else "other", mode=m) for k, m in modes.items()
        }
    )
    ledger = TransferLedger()
    pipe.residency = build_residency(plan, pipe.components, device="cpu", ledger=ledger)
    # The manager's size of the DiT (its budget check) counts the adapter slots too.
    assert pipe.residency.describe()["transformer"]["bytes"] == whole
    start = ledger.begin_window()
    offloaded = _pixels(pipe)
    assert np.abs(offloaded - resident).max() <= 1
    moved = [m for m in ledger.moves(start) if m.component == "transformer" and m.direction == "h2d" and m.layer]
    if mode == "component-offload":  # the whole DiT, slots included, moves as one unit
        assert not moved
        assert (
            sum(m.nbytes for m in ledger.moves(start) if m.component == "transformer" and m.direction == "h2d") == whole
        )
    assert {m.layer for m in moved} == (set(want) if mode == "layerwise-offload" else set())
    for move in moved:
        total, lora = want[move.layer]
        assert move.nbytes == total, (move.layer, move.nbytes, total, lora)
    # Outside a request the slots are detached like the weights (placeholders), not left on the device.
    assert all(b.numel() == 0 for n, b in transformer.named_buffers() if "diffuserve_lora" in n)
