"""Per-request LoRA under torch.compile (the DiT's repeated blocks, as `--enable-torch-compile` compiles them): the
compiled layers read the batch's adapters as a fixed-shape scale tensor over every slot, so a new mix of adapters
(another adapter, another scale, two summed) adds no graph (counted with torch._dynamo's counters), and the
compiled run equals the eager one (<= 1/255). Dynamo's `eager` backend: the guards, and so the recompiles, are
those of inductor, without its code generation time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.sampling import SamplingParams

MIXES = [
    (("style", 1.0),),
    (("ink", 1.0),),
    (("style", 0.5),),
    (("style", 0.7), ("ink", -1.2)),
]


@pytest.fixture(scope="module")
def adapters(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from diffuserve.lora.tiny import write_random_lora

    root = tmp_path_factory.mktemp("loras-compile")
    return {
        "style": str(write_random_lora(tiny_flux_path, root / "style", rank=4, seed=1)),
        "ink": str(write_random_lora(tiny_flux_path, root / "ink", rank=2, seed=2, targets=("to_q", "proj_mlp"))),
    }


def _pipeline(path: Path, adapters: dict[str, str]):
    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(path)
    install_lora(pipe, "flux", adapters, max_loras=4, max_rank=4, device="cpu", dtype=torch.float32)
    return pipe


def _image(pipe, lora) -> np.ndarray:
    params = SamplingParams(prompt="a cat", seed=3, num_inference_steps=2, width=64, height=64, lora=lora)
    with torch.inference_mode():
        return np.asarray(pipe.run([params]).outputs[0].images[0]).astype(np.int16)


def test_a_new_adapter_mix_does_not_recompile_and_equals_eager(tiny_flux_path, adapters) -> None:
    from torch._dynamo.utils import counters

    eager = _pipeline(tiny_flux_path, adapters)
    compiled = _pipeline(tiny_flux_path, adapters)
    torch._dynamo.reset()
    compiled.components["transformer"].compile_repeated_blocks(backend="eager", dynamic=True)
    first = _image(compiled, MIXES[0])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the blocks did compile
    images = [first] + [_image(compiled, mix) for mix in MIXES[1:]]
    assert counters["stats"]["unique_graphs"] == graphs, "a new adapter mix recompiled"
    for mix, image in zip(MIXES, images, strict=True):
        assert np.abs(image - _image(eager, mix)).max() <= 1, mix
    assert np.abs(images[0] - images[1]).max() > 3  # the mixes really differ
