"""The contract between the worker and a pipeline (native family adapter or the diffusers backend).

The worker hands a pipeline a list of `SamplingParams` (one per request of a batch) and gets back,
per request, its `n` outputs. Everything model-specific lives behind this interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from diffuserve.engine.request import SamplingParams


class ComponentUser(Protocol):
    """Residency hook point: a pipeline wraps each stage in `use(component)`.

    The residency manager (runtime/residency.py) implements it and moves weights on/off the device
    as the deployment plan says; the default does nothing (everything resident).
    """

    def use(self, component: str) -> contextlib.AbstractContextManager[None]: ...


class AllResident:
    """Default residency: every component stays where the loader put it."""

    @contextlib.contextmanager
    def use(self, component: str) -> Iterator[None]:
        yield


@dataclass
class RequestOutput:
    """The outputs of one request: `n` images, or `n` videos (each a list of frames)."""

    images: list[Image.Image] = field(default_factory=list)
    videos: list[list[Image.Image]] = field(default_factory=list)


@dataclass
class BatchResult:
    outputs: list[RequestOutput]
    """One entry per request, in the order the batch was given."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage (encode, latents, denoise, decode) for metrics."""


StepCallback = Callable[[int, int], None]
"""on_step(step_index, num_steps): called after each denoising step."""

StopCheck = Callable[[], bool]
"""should_stop(): checked between steps; True raises RequestCancelledError out of the loop."""


@dataclass(frozen=True)
class PipelineDefaults:
    """What a request gets for fields it leaves unset, per family."""

    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 28
    guidance_scale: float = 3.5
    num_frames: int = 1
    fps: int = 16


class Pipeline:
    """Base class of every pipeline. Subclasses implement `run` and declare their capabilities."""

    family: str = "unknown"
    output_kind: Literal["image", "video"] = "image"
    supports_batching: bool = True
    """False for families whose requests must run alone (dynamic batching treats them as ineligible)."""
    size_multiple: int = 16
    """Width/height must be multiples of this (VAE scale x patch size)."""
    max_pixels: int = 4096 * 4096
    defaults: PipelineDefaults = PipelineDefaults()

    def __init__(self) -> None:
        self.residency: ComponentUser = AllResident()
        self.components: dict[str, torch.nn.Module] = {}
        """model_index.json key -> module, for residency and metrics."""
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None

    def validate(self, params: SamplingParams) -> None:
        """Reject what this family cannot run, naming the field (InvalidRequestError)."""
        from diffuserve.errors import InvalidRequestError

        for name in ("width", "height"):
            value = getattr(params, name)
            if value <= 0 or value % self.size_multiple:
                raise InvalidRequestError(
                    f"{name}={value} is not a positive multiple of {self.size_multiple}, which this "
                    f"{self.family} model needs; choose e.g. {max(self.size_multiple, value // self.size_multiple * self.size_multiple)}.",
                    param="size",
                )
        if params.width * params.height > self.max_pixels:
            raise InvalidRequestError(
                f"size {params.width}x{params.height} exceeds this server's limit of {self.max_pixels} pixels.",
                param="size",
            )
        if self.output_kind == "image" and params.num_frames != 1:
            raise InvalidRequestError("num_frames must be 1 for an image model.", param="num_frames")

    def run(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> BatchResult:
        """Run one batch as one pipeline call; returns the outputs per request, in order."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Facts for /server_info and the start-up log."""
        return {
            "family": self.family,
            "output_kind": self.output_kind,
            "supports_batching": self.supports_batching,
            "size_multiple": self.size_multiple,
            "components": sorted(self.components),
        }
