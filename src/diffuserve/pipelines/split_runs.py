"""One batch, several recipe runs: rows whose values of the family spec's `run_apart_by` fields differ (LTX-2's
`fps`, which sets a row's audio length and its video positions) cannot share a denoiser call, yet share one
dispatch. `run_apart` runs the recipe once per value, in the batch's order of first appearance; `decode_apart`
decodes each run and puts the outputs back in the batch's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from diffuserve.pipelines.batch_rows import Denoised, DenoiseState
from diffuserve.pipelines.results import BatchResult

if TYPE_CHECKING:
    from diffuserve.sampling import SamplingParams


class Runs(Protocol):
    """What the split needs of the recipe (`RecipePipeline`): its two stages."""

    def run_to_latents(self, batch: list[SamplingParams], **hooks: Any) -> Denoised: ...

    def decode_batch(self, denoised: Denoised) -> BatchResult: ...


PARTS = "run_apart"
"""The combined `Denoised`'s extras key: (indices in the batch, that run's `Denoised`) per run."""


def groups(batch: Sequence[SamplingParams], fields: Sequence[str]) -> list[list[int]]:
    """The batch's request indices by their values of `fields`, in order of first appearance (one group: all)."""
    grouped: dict[tuple[Any, ...], list[int]] = {}
    for i, params in enumerate(batch):
        grouped.setdefault(tuple(getattr(params, f) for f in fields), []).append(i)
    return list(grouped.values())


def run_apart(pipe: Runs, batch: list[SamplingParams], parts: list[list[int]], **hooks: Any) -> Denoised:
    """One `run_to_latents` per group of `parts`; their stage seconds add up."""
    runs = [(index, pipe.run_to_latents([batch[i] for i in index], **hooks)) for index in parts]
    first = runs[0][1]
    seconds: dict[str, float] = {}
    for _, run in runs:
        for stage, value in run.stage_seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
    state = DenoiseState(latents=first.latents, timesteps=first.state.timesteps, scheduler=None, extras={PARTS: runs})
    return Denoised(batch=list(batch), latents=first.latents, state=state, stage_seconds=seconds)


def decode_apart(pipe: Runs, denoised: Denoised) -> BatchResult:
    """Decode each run of `run_apart` and put its outputs back at their requests' places."""
    outputs: list[Any] = [None] * len(denoised.batch)
    seconds = {k: v for k, v in denoised.stage_seconds.items() if k != "decode"}
    for index, run in denoised.state.extras[PARTS]:
        result = pipe.decode_batch(run)
        seconds["decode"] = seconds.get("decode", 0.0) + result.stage_seconds.get("decode", 0.0)
        for i, output in zip(index, result.outputs, strict=True):
            outputs[i] = output
    return BatchResult(outputs=outputs, stage_seconds=seconds)
