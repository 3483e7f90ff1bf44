"""The deployment plan's types: what `config/deployment.py` resolves and `runtime/` executes.

Kept apart from the resolver so the runtime can import the types without the resolution rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class ResidencyMode(str, enum.Enum):
    RESIDENT = "resident"
    """Weights stay on the device."""
    COMPONENT_OFFLOAD = "component-offload"
    """The whole component moves onto the device before a use and off after it."""
    SNAPSHOT_OFFLOAD = "snapshot-offload"
    """A host copy is kept for good, so offloading only frees device memory (no device->host copy)."""
    LAYERWISE_OFFLOAD = "layerwise-offload"
    """Declared layers stream onto the device with a prefetch depth; optional resident layer sets."""


class Lifetime(str, enum.Enum):
    FORWARD = "forward"
    """The resident layer set is placed when the component runs and returned after it."""
    PERMANENT = "permanent"
    """The resident layer set is placed at load and never moves (must fit, or start-up fails)."""


@dataclass
class ComponentPlan:
    """How one component (a model_index.json key such as `transformer`, `text_encoder_2`, `vae`) lives."""

    name: str
    """The model_index.json key."""
    group: str
    """dit | text_encoder | image_encoder | vae | other (used by selectors such as `dit=...`)."""
    mode: ResidencyMode = ResidencyMode.RESIDENT
    """Residency mode."""
    prefetch_size: int = 1
    """Layer-wise: streamed layers in flight ahead of the one computing (0 is treated as 1)."""
    resident_layers: int = 0
    """Layer-wise: how many of the declared layers stay on the device (the resident set)."""
    lifetime: Lifetime = Lifetime.FORWARD
    """Layer-wise: lifetime of the resident set."""
    pin_memory: bool = False
    """Keep host copies in pinned memory (CUDA only; ignored on CPU)."""
    quantization: str | None = None
    """The online quantization method of its Linear layers (fp8 | int8 | int8-dynamic), None: the compute dtype."""
    quant_keep: tuple[str, ...] = ()
    """Quantized component: module-name globs kept in the compute dtype (`config/quantization.py`)."""
    weight_bytes: int = 0
    """The component's weights once loaded (quantized ones at their stored size), as the plan counted them."""
    prequantized: str = ""
    """How its weights are stored when pre-quantized (`gguf:Q4_K`, `bfl:nvfp4`, `torchao`); empty: as loaded."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "weight_bytes": self.weight_bytes,
            "quantization": self.quantization or self.prequantized or None,
            "mode": self.mode.value,
            "prefetch_size": self.prefetch_size,
            "resident_layers": self.resident_layers,
            "lifetime": self.lifetime.value,
            "pin_memory": self.pin_memory,
        }


@dataclass
class DeploymentPlan:
    """The resolved deployment: residency per component, parallelism, compile switches, and why."""

    performance_mode: str = "auto"
    components: dict[str, ComponentPlan] = field(default_factory=dict)
    num_gpus: int = 1
    use_fsdp_inference: bool = False
    enable_cfg_parallel: bool = False
    ulysses_degree: int = 1
    ring_degree: int = 1
    sp_degree: int = 1
    """ulysses_degree x ring_degree."""
    tp_size: int = 1
    dp_size: int = 1
    """Data-parallel replicas; each has `ranks_per_replica` ranks."""
    enable_torch_compile: bool = False
    offload_during_compile: bool = True
    enable_breakable_cuda_graph: bool = False
    warmup_resolutions: list[str] = field(default_factory=list)
    activation_memory_bytes: int | None = None
    """Bytes of activations one replica may hold at once (activation.py: the free memory after the weights this
    plan keeps on the device, times a fraction, or `--activation-memory-gib`); None: unbounded or not resolved."""
    activation_memory_source: str = ""
    """How `activation_memory_bytes` was derived (printed by `diffuserve plan`, shown by /server_info)."""
    trace: list[str] = field(default_factory=list)
    """Human-readable reasons, one per decision, in the order they were made."""

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one replica: the degrees' product (or, with FSDP alone, every rank of the replica)."""
        return self.num_gpus // self.dp_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "performance_mode": self.performance_mode,
            "components": {k: v.to_dict() for k, v in self.components.items()},
            "num_gpus": self.num_gpus,
            "fsdp": self.use_fsdp_inference,
            "cfg_parallel": self.enable_cfg_parallel,
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "sp_degree": self.sp_degree,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "compile": {
                "enable_torch_compile": self.enable_torch_compile,
                "offload_during_compile": self.offload_during_compile,
                "enable_breakable_cuda_graph": self.enable_breakable_cuda_graph,
                "warmup_resolutions": list(self.warmup_resolutions),
            },
            "activation_memory": {
                "budget_gib": None
                if self.activation_memory_bytes is None
                else round(self.activation_memory_bytes / 1024**3, 3),
                "source": self.activation_memory_source,
            },
            "trace": list(self.trace),
        }
