"""Apply the plan's compile switches to a loaded pipeline, and refuse what this release cannot run.

torch.compile is applied to the DiT's repeated blocks (diffusers' `compile_repeated_blocks`, so one
compiled block serves every layer) or, for a transformer that declares none, to the whole module.
Compilation itself happens lazily on the first forward: the engine's warm-up (one generation per
`--warmup-resolutions` entry) pays for it before /health turns 200. With `--offload-during-compile` (on by
default) the engine runs that warm-up inside `residency.compile_warmup()` (runtime/residency.py), which
offloads every resident component, the DiT included, for its duration and restores the serving residency after.
"""

from __future__ import annotations

import logging
from typing import Any

from diffuserve.config.plan import DeploymentPlan
from diffuserve.errors import ConfigError

logger = logging.getLogger(__name__)


def check_executable(plan: DeploymentPlan) -> None:
    """Fail at start-up for plan features whose execution is not in this release (never a silent fallback)."""
    unavailable = [
        (plan.enable_breakable_cuda_graph, "--enable-breakable-cuda-graph", "breakable CUDA graphs"),
    ]
    for active, flag, what in unavailable:
        if active:
            raise ConfigError(
                f"{flag} {what} is resolved by the deployment plan but cannot run in this release; drop {flag}."
            )


def apply_compile(components: dict[str, Any], plan: DeploymentPlan, *, backend: str = "inductor") -> bool:
    """torch.compile the DiT when the plan says so; returns whether anything was compiled."""
    if not plan.enable_torch_compile:
        return False
    transformer = components.get("transformer")
    if transformer is None:
        raise ConfigError("--enable-torch-compile: this pipeline has no `transformer` component to compile.")
    if getattr(transformer, "_repeated_blocks", None):
        transformer.compile_repeated_blocks(backend=backend, dynamic=True)
        logger.info("torch.compile(%s): repeated blocks %s", backend, transformer._repeated_blocks)
    else:
        transformer.compile(backend=backend, dynamic=True)
        logger.info("torch.compile(%s): whole transformer", backend)
    return True
