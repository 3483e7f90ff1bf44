"""Compile switches reach the pipeline; plan features this release cannot execute fail at start-up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

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
    compiled_blocks = [m for m in pipeline.components["transformer"].modules() if hasattr(m, "_orig_mod") or
                       getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled_blocks, "no block was compiled"
    compiled = np.asarray(pipeline.run(params).outputs[0].images[0], dtype=np.int16)
    assert np.abs(compiled - reference).max() <= 1
