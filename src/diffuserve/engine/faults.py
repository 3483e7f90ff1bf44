"""Operator-only fault injection for failure tests.

Enabled only through the environment of the server process (`DIFFUSERVE_FAULT_INJECTION`), never
through the HTTP API: with `DIFFUSERVE_FAULT_INJECTION=prompt:<marker>` any batch containing a
request whose prompt contains `<marker>` raises inside the pipeline call, exactly as a failing
stage would. Tests use it to prove that a failing merged batch errors all of its requests and that
the server keeps serving.

`hold:<marker>` (alone, or after a comma: `prompt:<a>,hold:<b>`) slows instead of failing: a text encode or
decode that runs in a side lane beside the denoise loop (`pipelines/overlap.py`) for a request whose prompt
contains `<marker>` waits until the loop has run two more denoising steps (30 s at most). Tests use it to see
from the loop's own step counter that the loop kept stepping while that encode / decode ran.
"""

from __future__ import annotations

import os
from typing import Any

from diffuserve.pipelines.base import BatchResult, Pipeline

ENV_VAR = "DIFFUSERVE_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """The failure raised by a faulty pipeline stage (test-only)."""


class FaultInjectingPipeline:
    """Wraps a pipeline; raises InjectedFault for batches that contain the marker.

    A transparent proxy, not a `Pipeline` subclass: every attribute (output kind, defaults, size limits, the
    model description) is the wrapped family's own, so a wrapped Wan model is still a video model with its
    defaults; only `run` is intercepted.
    """

    def __init__(self, inner: Pipeline, marker: str):
        self.__dict__["_inner"] = inner
        self.__dict__["_marker"] = marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def run(self, batch: list[Any], **callbacks: Any) -> BatchResult:
        self._check(batch)
        return self._inner.run(batch, **callbacks)

    def run_to_latents(self, batch: list[Any], **callbacks: Any) -> Any:
        """The first part of `run` when its decode overlaps the next batch (`executor/worker.py`)."""
        self._check(batch)
        return self._inner.run_to_latents(batch, **callbacks)

    def _check(self, batch: list[Any]) -> None:
        if any(self._marker in p.prompt for p in batch):
            raise InjectedFault(f"injected fault: a prompt in this batch contains {self._marker!r}")


    def check_step(self, batch: list[Any]) -> None:
        """Continuous mode: the same fault for a denoising step whose rows include the marker."""
        if any(self._marker in p.prompt for p in batch):
            raise InjectedFault(f"injected fault: a prompt in this denoising step contains {self._marker!r}")


def maybe_inject_faults(pipeline: Pipeline) -> Pipeline | FaultInjectingPipeline:
    parts = dict(part.split(":", 1) for part in os.environ.get(ENV_VAR, "").split(",") if ":" in part)
    if parts.get("hold"):
        from diffuserve.pipelines.overlap import overlap_for

        overlap_for(pipeline).hold_marker = parts["hold"]
    if parts.get("prompt"):
        return FaultInjectingPipeline(pipeline, parts["prompt"])
    return pipeline
