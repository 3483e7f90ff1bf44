"""Compile switches reach the pipeline; plan features this release cannot execute fail at start-up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.config.plan import DeploymentPlan
from diffuserve.errors import ConfigError
from diffuserve.models.loader import load_pipeline
from diffuserve.runtime.compile import apply_compile, check_executable
from diffuserve.sampling import SamplingParams


def test_unexecutable_plan_features_fail_naming_the_flag():
    with pytest.raises(ConfigError, match="--enable-breakable-cuda-graph"):
        check_executable(DeploymentPlan(enable_breakable_cuda_graph=True))
    check_executable(DeploymentPlan(num_gpus=2, use_fsdp_inference=True, enable_cfg_parallel=True))  # these run now


def test_compiled_transformer_matches_eager(tiny_flux_path: Path):
    pipeline = load_pipeline(tiny_flux_path)
    params = [SamplingParams(prompt="compile me", width=32, height=32, num_inference_steps=2, seed=5)]
    reference = np.asarray(pipeline.run(params).outputs[0].images[0], dtype=np.int16)
    # The eager backend runs TorchDynamo's capture without code generation: it proves the wiring
    # (repeated blocks compiled, outputs unchanged) without minutes of inductor compilation on CPU.
    assert apply_compile(pipeline.components, DeploymentPlan(enable_torch_compile=True), backend="eager")
    assert not apply_compile(pipeline.components, DeploymentPlan(enable_torch_compile=False))
    compiled_blocks = [
        m
        for m in pipeline.components["transformer"].modules()
        if hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
    ]
    assert compiled_blocks, "no block was compiled"
    compiled = np.asarray(pipeline.run(params).outputs[0].images[0], dtype=np.int16)
    assert np.abs(compiled - reference).max() <= 1


# Compile warm-up with offload (--offload-during-compile) ----------------------------------------------------

RESIDENT = ("text_encoder", "text_encoder_2", "transformer", "vae")


def _warm_engine(tiny_flux_path: Path, plan: DeploymentPlan):
    """An engine whose load is serve's (host load, residency from the plan, compile) with the eager backend,
    and the ledger moves it made, each with the engine state at that moment."""
    from diffuserve.engine.engine import AsyncEngine, EngineConfig
    from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
    from diffuserve.executor.base import InProcessExecutor, ServingPipeline
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    ledger = TransferLedger()
    moves: list = []

    def load():
        pipeline = load_pipeline(tiny_flux_path, placement="host")
        pipeline.use_residency(build_residency(plan, pipeline.components, device="cpu", ledger=ledger))
        apply_compile(pipeline.components, plan, backend="eager")
        return ServingPipeline.of(pipeline)

    batcher = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=1, delay_ms=0), model_names=["tiny"])
    engine = AsyncEngine(InProcessExecutor(load), batcher, config=EngineConfig(enable_warmup=True, warmup_steps=1))
    ledger.add_listener(lambda move: moves.append((move, engine.state.name)))
    engine.start()
    try:
        assert engine.wait_ready(180) and engine.state.name == "READY", engine.failure
    finally:
        engine.stop()
    return engine, ledger, moves


def test_compile_warmup_offloads_and_restores_the_serving_residency(tiny_flux_path: Path):
    from diffuserve.runtime.residency import GUARD_HOOK

    engine, ledger, moves = _warm_engine(tiny_flux_path, DeploymentPlan(enable_torch_compile=True))
    pipeline, manager = engine.pipeline, engine.pipeline.residency
    sizes = {name: manager.strategies[name].nbytes for name in RESIDENT}
    warm = [m for m, state in moves if state == "WARMING_UP"]
    assert [m.component for m, state in moves if state == "LOADING"] == list(RESIDENT)  # placed at load
    assert all(state != "READY" for _, state in moves)  # everything was back before the engine turned ready
    # Warm-up opens by taking every resident component (the DiT included) to the host ...
    assert [(m.component, m.direction, m.nbytes) for m in warm[:4]] == [(c, "d2h", sizes[c]) for c in RESIDENT]
    assert warm[3].device_bytes_after == 0
    # ... runs the warm-up generation with one component on the device at a time (the DiT came on to compile) ...
    during = warm[4:-4]
    assert ("transformer", "h2d") in {(m.component, m.direction) for m in during}
    assert max(m.device_bytes_after for m in during) <= max(sizes.values())
    # ... and ends by putting the serving residency back: all four resident, no hooks left.
    assert [(m.component, m.direction) for m in warm[-4:]] == [(c, "h2d") for c in RESIDENT]
    assert {name: ledger.device_bytes(name) for name in RESIDENT} == sizes
    assert {name: type(s).__name__ for name, s in manager.strategies.items()} == dict.fromkeys(
        RESIDENT, "ResidentStrategy"
    )
    guarded = [
        type(m).__name__
        for name in RESIDENT
        for m in [pipeline.components[name], *pipeline.components[name].children()]
        if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook(GUARD_HOOK) is not None
    ]
    assert guarded == []
    # Serving after warm-up moves nothing: the components are resident again.
    seq = len(ledger.moves())
    pipeline.run([SamplingParams(prompt="after warm-up", width=32, height=32, num_inference_steps=1, seed=1)])
    assert ledger.moves(since=seq) == []


def test_offload_during_compile_false_leaves_placement_alone(tiny_flux_path: Path):
    _, _, moves = _warm_engine(tiny_flux_path, DeploymentPlan(enable_torch_compile=True, offload_during_compile=False))
    assert [(m.component, m.direction, state) for m, state in moves] == [(c, "h2d", "LOADING") for c in RESIDENT]


def test_compile_warmup_keeps_planned_offload_and_detaches_the_evicted(tiny_flux_path: Path):
    from diffuserve.config.plan import ComponentPlan, ResidencyMode
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import OffloadedWeightsError, build_residency

    plan = DeploymentPlan(
        enable_torch_compile=True,
        components={
            "transformer": ComponentPlan(name="transformer", group="dit", mode=ResidencyMode.LAYERWISE_OFFLOAD)
        },
    )
    pipeline = load_pipeline(tiny_flux_path, placement="host")
    manager = build_residency(plan, pipeline.components, device="cpu", ledger=TransferLedger())
    try:
        kinds = {name: type(s).__name__ for name, s in manager.strategies.items()}
        with manager.compile_warmup():
            during = {name: type(s).__name__ for name, s in manager.strategies.items()}
            vae = pipeline.components["vae"]
            with pytest.raises(OffloadedWeightsError, match="vae"):
                vae.decode(torch.zeros(1, vae.config.latent_channels, 4, 4))  # evicted: its weights are on the host
        assert during == {**dict.fromkeys(kinds, "WholeOffloadStrategy"), "transformer": "LayerwiseStrategy"}
        assert {name: type(s).__name__ for name, s in manager.strategies.items()} == kinds
        vae.decode(torch.zeros(1, vae.config.latent_channels, 4, 4))  # resident again
    finally:
        manager.close()
