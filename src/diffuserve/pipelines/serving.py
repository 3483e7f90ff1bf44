"""The object that serves: a loaded pipeline with its residency, side lanes, parallel strategies and (operator-only)
fault hooks as declared fields, and its `Capabilities`.

`launch/setup.py` builds one per rank (`ServingPipeline.of`); the executor runs batches and continuous steps on it
and the engine reads its capabilities and model description. Residency and CFG parallel go in through the pipeline's
own `use_residency` / `use_cfg_parallel`, the side lanes are the pipeline's `lanes()`, and fault injection is
the `faults` hook, consulted around every call. The parallel strategies go in through declared fields too
(`sequence_parallel`, and `agree_over` for the weight-sharding ones whose ranks take rank 0's step-cache
measures: `parallel/agreement.py`), and so do the start-up parts loaded beside the checkpoint, before the pipeline
is wrapped here: `--controlnet`'s ControlNets through `use_controlnets` (`models/controlnets.py`), LoRA slots
through `use_lora` or `load_lora_adapters` (`lora/slots.py`). Code outside `pipelines/` reads the pipeline's
declared fields (`denoisers`, `supports_controlnet`, ...) and never probes it with `getattr`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from diffuserve.pipelines.base import Pipeline, Residency
from diffuserve.pipelines.capabilities import Capabilities
from diffuserve.pipelines.results import BatchResult

if TYPE_CHECKING:
    from diffuserve.family_spec.base import SamplingDefaults
    from diffuserve.pipelines.lanes import Lanes
    from diffuserve.sampling import ModelDescription, SamplingParams

__all__ = ["Capabilities", "FaultHooks", "ServingPipeline"]


class FaultHooks(Protocol):
    """Operator-only fault injection (`pipelines/fault_hooks.py`), consulted around every pipeline call and step."""

    def check(self, batch: Sequence[Any]) -> None:
        """Raise before a request-level call whose prompts are marked to fail."""

    def hold(self, batch: Sequence[Any], hooks: dict[str, Any]) -> dict[str, Any]:
        """The call's hooks, with `on_step` held until released when its prompts are marked to hold."""
        return hooks

    def check_step(self, batch: Sequence[Any]) -> None:
        """Continuous mode, before a step: the same fault (and hold) for a step whose rows are marked."""


@dataclass
class ServingPipeline:
    """One rank's serving pipeline. `run` / `run_to_latents` / `decode_batch` have the served pipeline's signatures."""

    served: Pipeline
    """The pipeline it serves (a native family's `RecipePipeline`, the diffusers backend, Hunyuan3D's own loop)."""
    capabilities: Capabilities = field(default_factory=Capabilities)
    """What it can do (`Pipeline.capabilities`, read once at build)."""
    lanes: Lanes | None = None
    """The pipeline's encode / decode side lanes when it defers its decode; None: everything runs in line."""
    parallel: tuple[str, ...] = ()
    """The parallel modes applied on this rank (for the log and /server_info)."""
    faults: FaultHooks | None = None
    """Operator-only fault injection (`DIFFUSERVE_FAULT_INJECTION`); None in normal serving."""

    @classmethod
    def of(cls, served: Pipeline, *, parallel: Sequence[str] = (), faults: FaultHooks | None = None) -> ServingPipeline:
        """Serve `served` as it is now (residency and parallel strategies already in place)."""
        capabilities = served.capabilities
        lanes = served.lanes() if capabilities.defers_decode else None
        return cls(served, capabilities, lanes, tuple(parallel), faults)

    # -- calls --------------------------------------------------------------------------------------------
    def run(self, batch: list[SamplingParams], **hooks: Any) -> BatchResult:
        if self.faults is not None:
            self.faults.check(batch)
            hooks = self.faults.hold(batch, hooks)
        return self.served.run(batch, **hooks)

    def run_to_latents(self, batch: list[SamplingParams], **hooks: Any) -> Any:
        """The first part of `run` when its decode runs in the decode lane (`executor/batch_runner.py`)."""
        if self.faults is not None:
            self.faults.check(batch)
            hooks = self.faults.hold(batch, hooks)
        return self.served.run_to_latents(batch, **hooks)  # type: ignore[attr-defined]

    def decode_batch(self, denoised: Any) -> BatchResult:
        return self.served.decode_batch(denoised)  # type: ignore[attr-defined]

    def check_step(self, batch: Sequence[Any]) -> None:
        """Continuous mode, before each step of rows whose params are `batch` (fault injection only)."""
        if self.faults is not None:
            self.faults.check_step(batch)

    def prefetch_text(self, params: SamplingParams, on_done: Callable[[int], None]) -> bool:
        """Encode a queued request's texts beside the running batch; False when the pipeline cannot."""
        return self.capabilities.text_prefetch and self.served.prefetch_text(params, on_done=on_done)

    # -- what the engine and the server read -----------------------------------------------------------------
    @property
    def residency(self) -> Residency:
        return self.served.residency

    @property
    def output_kind(self) -> str:
        return self.served.output_kind

    @property
    def family(self) -> str:
        return self.served.family

    @property
    def device(self) -> Any:
        return self.served.device

    @property
    def defaults(self) -> SamplingDefaults:
        return self.served.defaults

    @property
    def components(self) -> dict[str, Any]:
        return self.served.components

    def describe_model(self) -> ModelDescription:
        return self.served.describe_model()

    def describe(self) -> dict[str, Any]:
        return self.served.describe()
