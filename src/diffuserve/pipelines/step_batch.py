"""The shared recipe (`recipe.RecipePipeline`) cut into resumable pieces, for step-level (continuous) batching.

`RecipePipeline.run` is encode -> prepare -> denoise loop -> decode for one fixed batch. Here the same family
parts run per request instead, so requests can enter and leave a running denoise group at step boundaries:

* `start_request(s)`: encode the request's prompt(s) and prepare its latents, schedule and a private scheduler
  (`RequestRows`: its `n` latent rows, its conditioning, its own step index); requests joining at one boundary
  share their encoder calls.
* `denoise_step`: ONE denoiser call (two with unbatched CFG) for the rows of several requests, each at its own
  timestep (the transformer takes a per-row timestep vector), then each request's own scheduler step. A family
  with two experts (Wan2.2 A14B) makes one call per expert the rows need at that step.
* `preview_request` / `finish_request(s)`: a partial image, or the final decode, of one request's rows (requests
  finishing at one step share a decoder call; the engine
  runs them, and `start_request`, in the side lanes of `pipelines/lanes.py`, beside the loop).

Seeds and noise are those of `run` for a batch of one (`recipe.batch_noise`), and each request's scheduler is a
`fresh_scheduler` copy, so a request's rows equal its singleton run up to the float reordering of batched kernels.
Only families that declare `supports_continuous` (see `Pipeline.supports_continuous`) may be stepped this way:
their per-batch `extras` must be equal across requests of one group key (`engine/step_scheduler.py`), and their
scheduler step must depend only on the request's own state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffuserve.pipelines import packing
from diffuserve.pipelines.recipe import Cond, DenoiseState, RecipePipeline, concat_cond, gather_rows
from diffuserve.pipelines.results import RequestOutput
from diffuserve.step_cache.hooks import RowCache, new_row_caches, step_counts


@dataclass(eq=False)
class RequestRows:
    """One request's denoising state between steps."""

    params: Any
    """The request's SamplingParams."""
    latents: torch.Tensor
    """Its `n` latent rows."""
    positive: Cond
    negative: Cond | None
    state: DenoiseState
    """Its own schedule, private scheduler and extras (from the family's `prepare`)."""
    step_index: int = 0
    """Steps done; the next step runs `state.timesteps[step_index]`."""
    cache: list[RowCache] | None = None
    """Its rows' step caches (None: it asked for none); each row decides from its own history."""

    @property
    def num_steps(self) -> int:
        return len(self.state.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


def start_request(pipeline: RecipePipeline, params: Any) -> RequestRows:
    """Encode and prepare one request (the first two stages of `run`, for a batch of one)."""
    return start_requests(pipeline, [params])[0]


def start_requests(pipeline: RecipePipeline, batch: Sequence[Any]) -> list[RequestRows]:
    """Encode and prepare requests of one group that join at the same boundary: their distinct texts go through
    each text encoder in one call (as `run` encodes a batch), then each request gets its own conditioning rows
    (trimmed as if it had been encoded alone), latents, schedule and scheduler, as `start_request` would."""
    batch = list(batch)
    with torch.inference_mode():
        positive, negative = pipeline.encode_batch(batch, pipeline.uses_cfg(batch[0]))
        out, first = [], 0
        for params in batch:
            index = torch.arange(first, first + params.n)
            first += params.n
            own = gather_rows(positive, index, pipeline.adapter.masked_sequences)
            own_negative = None if negative is None else gather_rows(negative, index, pipeline.adapter.masked_sequences)
            with contextlib.ExitStack() as scope:
                for key in pipeline.prepare_components(params):
                    scope.enter_context(pipeline.component_scope(key))
                state = pipeline.prepare([params], params, own)
            out.append(
                RequestRows(
                    params=params,
                    latents=state.latents,
                    positive=own,
                    negative=own_negative,
                    state=state,
                    cache=new_row_caches(params.step_cache, params.n, len(state.timesteps)),
                )
            )
    return out


def start_group(pipeline: RecipePipeline, batch: Sequence[Any]) -> list[RequestRows | Exception]:
    """`start_requests` for requests joining together; if it raises, each starts alone, so a request whose start
    raises fails alone (its slot holds the exception)."""
    try:  # their distinct texts share the encoder calls
        return list(start_requests(pipeline, batch))
    except Exception:
        if len(batch) == 1:
            raise
    results: list[RequestRows | Exception] = []
    for params in batch:
        try:
            results.append(start_request(pipeline, params))
        except Exception as exc:
            results.append(exc)
    return results


def _stack(conds: Sequence[Cond], masked: dict[str, str]) -> Cond:
    out = conds[0]
    for cond in conds[1:]:
        out = concat_cond(out, cond, masked)
    return out


class GroupConds:
    """The stacked conditioning of the last group stepped, per denoiser, kept by whoever steps the group (the
    engine's StepRunner, a follower rank's loop) across steps; one per stepping thread."""

    def __init__(self) -> None:
        self._by_denoiser: dict[str, tuple[list[RequestRows], Cond, Cond | None]] = {}

    def stacked(self, pipeline: RecipePipeline, model_key: str, group: list[RequestRows]) -> tuple[Cond, Cond | None]:
        """The stacked conditioning of `group`, the same tensors for as long as the group (of this denoiser) does
        not change: as in `run`, where every step gets the same tensors (Qwen-Image 2.1 finds its prefix KV cache
        by them; a new stack per step would miss it and add a cache every step)."""
        found = self._by_denoiser.get(model_key)
        if (
            found is not None
            and len(found[0]) == len(group)
            and all(a is b for a, b in zip(found[0], group, strict=True))
        ):
            return found[1], found[2]
        positive = _stack([r.positive for r in group], pipeline.adapter.masked_sequences)
        negatives = [r.negative for r in group]
        negative = None if negatives[0] is None else _stack(negatives, pipeline.adapter.masked_sequences)  # type: ignore[arg-type]
        self._by_denoiser[model_key] = (list(group), positive, negative)
        return positive, negative


def denoise_step(pipeline: RecipePipeline, group: Sequence[RequestRows], conds: GroupConds | None = None) -> None:
    """One denoising step for every request of `group`, each at its own step index.

    Rows that need the same denoiser this step share ONE call (two with unbatched CFG); a family with several
    denoisers (Wan2.2 A14B's two experts, chosen by timestep) makes one call per expert the group's rows need,
    in the order of the group. The rows' latents advance in place (`RequestRows.latents`, `step_index`).
    `conds` is the caller's cache of the group's stacked conditioning, kept across steps (every serving loop
    passes one); None stacks afresh for this step only.
    """
    conds = conds if conds is not None else GroupConds()
    parts: dict[str, list[RequestRows]] = {}
    for rows in group:
        t = rows.state.timesteps[rows.step_index]
        parts.setdefault(pipeline.denoiser_for_step(rows.step_index, t, rows.state), []).append(rows)
    for model_key, part in parts.items():
        _step_part(pipeline, model_key, part, conds)


def _step_part(pipeline: RecipePipeline, model_key: str, group: list[RequestRows], conds: GroupConds) -> None:
    if len({latent_shape(r.latents) for r in group}) > 1:  # several sizes: packed (pipelines/packing.py)
        return _step_mixed(pipeline, model_key, group, conds, _step_part)
    head = group[0]
    timesteps = [rows.state.timesteps[rows.step_index] for rows in group]
    with torch.inference_mode(), pipeline.residency.use(model_key):
        latents = torch.cat([r.latents for r in group])
        timestep = torch.cat([t.expand(r.latents.shape[0]) for r, t in zip(group, timesteps, strict=True)])
        positive, negative = conds.stacked(pipeline, model_key, group)
        # One state for the call: the head's schedule (the guidance combine reads its step's expert), with the
        # extras of the whole group (`step_extras`: equal across the group key, or merged where they count rows).
        state = dataclasses.replace(head.state, extras=pipeline.step_extras([r.state for r in group]))
        # The step-cache method is in the group key: every request of the group has caches, or none has.
        caches = [c for r in group for c in (r.cache or [])] or None
        # The adapters follow this call's rows: the group changes between steps (joins, leaves, the other expert).
        with pipeline.lora_scope([r.params for r in group]):
            noise_pred = pipeline.guided_prediction(
                latents, timestep, positive, negative, head.params, state, head.step_index, model_key, caches
            )
        for rows, t, pred in zip(group, timesteps, noise_pred.split([r.latents.shape[0] for r in group]), strict=True):
            rows.latents = pipeline.scheduler_step(pred, t, rows.latents, rows.state)
            rows.step_index += 1


def snapshot(rows: RequestRows) -> RequestRows:
    """A copy of `rows` as they are now, for a preview made in the decode lane while the loop steps on (the
    latents are replaced, never written in place, by each step; the extras dict is copied: FLUX.1 keeps the
    step's velocity there for its preview)."""
    state = dataclasses.replace(rows.state, extras=dict(rows.state.extras))
    return dataclasses.replace(rows, state=state)


def preview_request(pipeline: RecipePipeline, rows: RequestRows) -> list[Any]:
    """A partial image per row of the request's current latents (the family's `preview`)."""
    with torch.inference_mode(), pipeline.decoder_scope():
        return pipeline.preview(rows.latents, rows.state)


def finish_request(pipeline: RecipePipeline, rows: RequestRows) -> RequestOutput:
    """Decode the request's final latents: its output, as `run` would give it."""
    return finish_requests(pipeline, [rows])[0]


def finish_requests(pipeline: RecipePipeline, group: Sequence[RequestRows]) -> list[RequestOutput]:
    """Decode requests of one group that finished at the same step in ONE decoder call (they share the latent
    shape: the group key; requests of several sizes decode per size), then split the rows back per request. A family
    with sound (LTX-2) leaves one waveform per row in the decode's `extras["audios"]` (at its `sample_rate`); they
    are split back the same way."""
    shapes = list(dict.fromkeys(latent_shape(r.latents) for r in group))
    if len(shapes) > 1:
        done = {id(r): out for s in shapes for r, out in zip(*_finished_shape(pipeline, group, s), strict=True)}
        return [done[id(r)] for r in group]
    latents = torch.cat([r.latents for r in group])
    state = dataclasses.replace(group[0].state, extras=dict(pipeline.step_extras([r.state for r in group])))
    with torch.inference_mode(), pipeline.decoder_scope():
        decoded = pipeline.decode(latents, state)
    audios = state.extras.pop("audios", None)
    outputs, first = [], 0
    for rows in group:
        count = rows.latents.shape[0]
        mine = list(decoded[first : first + count])
        counts = step_counts(rows.cache)
        output = (
            RequestOutput(videos=mine, step_cache=counts)
            if pipeline.output_kind == "video"
            else RequestOutput(images=mine, step_cache=counts)
        )
        if audios is not None:
            output.audios = list(audios[first : first + count])
            output.audio_sample_rate = pipeline.audio_sample_rate
        first += count
        outputs.append(output)
    return outputs


def _finished_shape(
    pipeline: RecipePipeline, group: Sequence[RequestRows], shape: tuple[int, ...]
) -> tuple[list, list]:
    part = [r for r in group if latent_shape(r.latents) == shape]
    return part, finish_requests(pipeline, part)


def _step_mixed(pipe: RecipePipeline, model_key: str, group: list[Any], conds: Any, step_part: Any) -> None:
    """One continuous step for requests (`step_batch.RequestRows`) of several sizes: ONE packed call for the
    group where the family packs and `packing_problem` names nothing, else one `step_part` call per size."""
    head = group[0]
    if not pipe.packs_mixed_sizes or pipe.packing_problem(head.params, [r.params for r in group]) is not None:
        by_shape: dict[tuple[int, ...], list[Any]] = {}
        for rows in group:
            by_shape.setdefault(latent_shape(rows.latents), []).append(rows)
        for part in by_shape.values():
            step_part(pipe, model_key, part, conds)
        return
    groups, start = [], 0
    for rows in group:
        n = rows.latents.shape[0]
        spatial = latent_shape(rows.latents) if rows.latents.ndim == 4 else None
        tokens = rows.latents.flatten(2).transpose(1, 2) if spatial is not None else rows.latents
        state = DenoiseState(tokens, rows.state.timesteps, rows.state.scheduler, rows.state.extras)
        groups.append(
            packing.SizeGroup(batch=[rows.params], rows=slice(start, start + n), state=state, spatial=spatial)
        )
        start += n
    timesteps = [rows.state.timesteps[rows.step_index] for rows in group]
    with torch.inference_mode(), pipe.residency.use(model_key):
        positive, negative = conds.stacked(pipe, model_key, group)
        layout = pipe.packed_layout(groups, positive)
        latents = packing.pad_tokens([g.state.latents for g in groups], max(g.tokens for g in groups))
        packed = packing.Packed(groups=groups, layout=layout, order=list(range(len(group))))
        extras = {"packed": packed, **pipe.packed_extras(groups, layout, positive)}
        state = DenoiseState(latents, head.state.timesteps, None, extras)
        timestep = torch.cat([t.expand(r.latents.shape[0]) for r, t in zip(group, timesteps, strict=True)])
        caches = [c for r in group for c in (r.cache or [])] or None
        with pipe.lora_scope([r.params for r in group]):
            pred = pipe.guided_prediction(
                latents, timestep, positive, negative, head.params, state, head.step_index, model_key, caches
            )
        for rows, g, t in zip(group, groups, timesteps, strict=True):
            rows.latents = pipe.scheduler_step(g.latents_of(pred[g.rows]), t, rows.latents, rows.state)
            rows.step_index += 1


def latent_shape(latents: torch.Tensor) -> tuple[int, ...]:
    """A request's latent shape less its rows: what must match for its rows to concatenate with another's."""
    return tuple(latents.shape[1:])
