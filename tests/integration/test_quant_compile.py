"""`torch.compile` of a quantized DiT (`--quantization` with `--enable-torch-compile`, issue 28 item 4): the DiT's
repeated blocks compile with their quantized layers inside one graph each (no graph break, so none per layer), a
new batch mix (more rows, other prompts, true CFG's doubled rows) adds no graph (torch._dynamo's counters, as in
test_lora_compile.py), and the compiled run equals the eager one (<= 1/255). Backends `eager` / `aot_eager`: the
guards, and so the recompiles, of inductor without its code generation time (`aot_eager` also traces the kernels
through AOTAutograd with fake tensors, torchao's custom ops included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.sampling import SamplingParams

BACKENDS = {"fp8": "eager", "int8": "eager", "int8-dynamic": "aot_eager"}
"""Dynamo's `eager` backend for the weight-only methods (plain torch ops: dynamo's capture and guards are the
question); `aot_eager` for int8-dynamic, whose torchao GEMM enters the graph whole and must trace under AOT."""


def _mixes() -> list[list[SamplingParams]]:
    common = {"width": 64, "height": 64, "num_inference_steps": 2}
    return [
        # Two rows first: a batch of one would specialize the batch size to 1 (dynamo does for every model).
        [SamplingParams(prompt="a cat", seed=3, n=2, **common)],
        [  # another mix: more rows, other prompts, true CFG's doubled rows (positive and negative in one call)
            SamplingParams(prompt="a boat", seed=7, true_cfg_scale=3.0, negative_prompt="dark", **common),
            SamplingParams(prompt="a lamp", seed=2, true_cfg_scale=3.0, negative_prompt="blurry", **common),
        ],
    ]


def _images(pipe, batch) -> list[np.ndarray]:
    with torch.inference_mode():
        outputs = pipe.run(batch).outputs
    return [np.asarray(image).astype(np.int16) for out in outputs for image in out.images]


@pytest.mark.parametrize("method", BACKENDS)
def test_quantized_dit_compiles_without_graph_breaks_or_recompiles(tiny_flux_path: Path, method: str) -> None:
    from torch._dynamo.utils import counters

    from diffuserve import family_spec
    from diffuserve.config.plan import DeploymentPlan
    from diffuserve.models.loader import load_pipeline
    from diffuserve.quant.linear import QuantizedLinear
    from diffuserve.runtime.compile import apply_compile

    pipe = load_pipeline(tiny_flux_path, quantization={"transformer": (method, family_spec.spec_for("flux").quant_keep)})
    dit = pipe.components["transformer"]
    assert sum(isinstance(m, QuantizedLinear) for m in dit.modules()) > 10
    mixes = _mixes()
    eager = [_images(pipe, batch) for batch in mixes]

    torch._dynamo.reset()
    counters.clear()
    assert apply_compile(pipe.components, DeploymentPlan(enable_torch_compile=True), backend=BACKENDS[method])
    first = _images(pipe, mixes[0])
    graphs = counters["stats"]["unique_graphs"]
    # One graph per repeated block class (FLUX: the double and the single block), not one per quantized layer.
    assert 0 < graphs <= len(dit._repeated_blocks), dict(counters["stats"])
    compiled = [first] + [_images(pipe, batch) for batch in mixes[1:]]
    assert counters["stats"]["unique_graphs"] == graphs, "a new batch mix recompiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    for mix, (ours, theirs) in enumerate(zip(compiled, eager, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            assert np.abs(a - b).max() <= 1, (method, mix)
