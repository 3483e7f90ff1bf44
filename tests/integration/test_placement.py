"""Weight placement belongs to the residency layer: the loader loads to host (the residency manager moves
resident components to the device, offloaded ones never reach it whole) or to meta (no storage, no file read;
`materialize_module` reads the weights later). Both give the same images as the default device load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.errors import ConfigError
from diffuserve.models.loader import load_pipeline
from diffuserve.models.materialize import is_meta, materialize_module, weight_files
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.runtime.residency import build_residency
from diffuserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(180)

PARAMS = [SamplingParams(prompt="a red cat", width=64, height=64, num_inference_steps=2, seed=7)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _pixels(pipeline) -> np.ndarray:
    return np.asarray(pipeline.run(PARAMS).outputs[0].images[0], dtype=np.int16)


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture(scope="module")
def reference(tiny_flux_path: Path) -> np.ndarray:
    return _pixels(load_pipeline(tiny_flux_path))


@pytest.mark.parametrize("device", DEVICES)
def test_host_load_leaves_placement_to_residency(tiny_flux_path, reference, device, monkeypatch):
    # Every whole-module move (`Module.to`) is what puts a component on the device at once: watch them.
    moved: list[str] = []
    original_to = torch.nn.Module.to

    def watched_to(self, *args, **kwargs):
        moved.append(type(self).__name__)
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", watched_to)
    pipe = load_pipeline(tiny_flux_path, device=device, placement="host")
    assert moved == []  # the loader placed nothing
    assert all(p.device.type == "cpu" for m in pipe.components.values() for p in m.parameters())
    dit_bytes = _nbytes(pipe.adapter.transformer)
    plan = DeploymentPlan(
        components={"transformer": ComponentPlan(name="transformer", group="dit", mode=ResidencyMode.COMPONENT_OFFLOAD)}
    )
    ledger = TransferLedger()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pipe.residency = build_residency(plan, pipe.components, device=device, ledger=ledger)
    try:
        # The residency layer moved the resident components, and only those, to the device ...
        assert sorted(moved) == sorted(
            type(pipe.components[k]).__name__ for k in ("text_encoder", "text_encoder_2", "vae")
        )
        assert {m.component for m in ledger.moves()} == {"text_encoder", "text_encoder_2", "vae"}
        # ... while the offloaded DiT stayed on the host: detached placeholders on the module, no device bytes.
        assert ledger.peak_bytes("transformer") == 0
        assert all(p.numel() == 0 for p in pipe.adapter.transformer.parameters())
        if device == "cuda":
            resident = sum(_nbytes(pipe.components[k]) for k in ("text_encoder", "text_encoder_2", "vae"))
            assert torch.cuda.max_memory_allocated() < resident + dit_bytes // 2
        # A request brings it on once, whole, and the images equal the device-loaded run.
        ledger.begin_window()
        assert np.abs(_pixels(pipe) - reference).max() <= (0 if device == "cpu" else 2)
        summary = ledger.window_summary()
        assert summary.bytes("transformer", "h2d") == dit_bytes
    finally:
        pipe.residency.close()


def test_meta_load_reads_nothing_until_materialized(tiny_flux_path, reference):
    pipe = load_pipeline(tiny_flux_path, placement="meta")
    modules = {k: m for k, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert modules and all(is_meta(m) for m in modules.values())
    with pytest.raises((NotImplementedError, RuntimeError)):
        _pixels(pipe)  # no weights yet: a meta forward cannot run
    for key, module in modules.items():
        in_files = weight_files(tiny_flux_path / key)
        expected = sum(
            t.numel() * t.element_size()
            for name, t in [*module.named_parameters(), *module.named_buffers()]
            if name in in_files
        )
        assert materialize_module(module, tiny_flux_path / key, device="cpu") == expected, key
        assert not is_meta(module)
    # Same weights; only their addresses differ (diffusers' load can leave tensors unaligned, which moves CPU
    # kernels by ~1e-6; see STACK.md), so a pixel may move by one level.
    assert np.abs(_pixels(pipe) - reference).max() <= 1


def test_placement_errors_name_the_parameter(tiny_flux_path, tiny_sd3_path):
    with pytest.raises(ConfigError, match="not one of") as info:
        load_pipeline(tiny_flux_path, placement="gpu")
    assert info.value.param == "placement"
    with pytest.raises(ConfigError, match="no model component") as info:
        load_pipeline(tiny_flux_path, placement={"unet": "meta"})
    with pytest.raises(ConfigError, match="diffusers backend"):
        load_pipeline(tiny_sd3_path, backend="diffusers", placement="meta")


def test_mapping_places_named_components_and_the_rest_on_host(tiny_flux_path):
    pipe = load_pipeline(tiny_flux_path, placement={"transformer": "meta"})
    assert is_meta(pipe.adapter.transformer)
    assert not any(is_meta(pipe.components[k]) for k in ("text_encoder", "text_encoder_2", "vae"))
