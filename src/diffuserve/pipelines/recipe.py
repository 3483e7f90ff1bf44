"""The denoising recipe, once for every native family: `RecipePipeline(adapter)`, the pipeline the engine serves.

A family adapter (`pipelines/adapter.py`) is a plain object with the family's parts: encode_text / prepare /
predict (one denoiser call) / decode, and where its family needs them the optional ones (its own guidance combine, a
per-step choice of denoiser, packing). The recipe is composed from it and from the serving parts handed to it
(residency, LoRA bank, ControlNets, CFG parallel, the sequence split, lanes); nothing of it is inherited by an
adapter. It owns the rest: checking the batch signature, encoding each distinct text once and gathering one
conditioning row per output, timing per stage, residency scopes per stage and per denoiser, the CFG choice (two passes
or one doubled batch), cancellation between steps, progress and previews, and splitting the rows back per request.

The batch pieces it shares with the continuous steps (seeds, noise, rows, conditioning) are in
`pipelines/batch_rows.py` (re-exported here, so an adapter reads `recipe.row_generators`, `recipe.Cond`, ...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from diffuserve.errors import RequestCancelledError
from diffuserve.pipelines import inpaint as inpaint_rows
from diffuserve.pipelines import packing, packing_run, split_runs
from diffuserve.pipelines.adapter import OPTIONAL, AdapterBase
from diffuserve.pipelines.base import (
    BatchResult,
    Pipeline,
    PreviewCallback,
    RequestOutput,
    Residency,
    StepCallback,
    StopCheck,
)
from diffuserve.pipelines.batch_rows import (  # noqa: F401 - re-exported: adapters call them as `recipe.X`
    MAX_SEED,
    Cond,
    Denoised,
    DenoiseState,
    StageTimer,
    batch_noise,
    cached_schedule,
    check_batch,
    combine_cfg,
    concat_cond,
    dynamic_shift_mu,
    fresh_scheduler,
    gather_rows,
    has_flow_shift,
    num_rows,
    pad_to,
    resolve_seed,
    row_generators,
    row_seeds,
    rows_per_request,
    scheduler_template,
    to_pil_images,
)
from diffuserve.pipelines.lanes import lanes_for
from diffuserve.pipelines.recipe_text import TextStage
from diffuserve.step_cache import hooks as step_cache_hooks
from diffuserve.step_cache.hooks import RowCache, step_counts
from diffuserve.step_cache.rows import batch_row_caches

if TYPE_CHECKING:
    from diffuserve.lora.layers import LoraBank
    from diffuserve.pipelines.controlnet import LoadedControlNet
    from diffuserve.pipelines.packing import PackedRows, SizeGroup
    from diffuserve.sampling import SamplingParams

T = TypeVar("T")

# -- the recipe ---------------------------------------------------------------------------------------------


class RecipePipeline(Pipeline):
    """The pipeline of every native family: drives the family `adapter` (`FamilyAdapter`) through `run` once for all.

    Composed, not inherited: `adapter` holds the checkpoint's parts and facts, `residency` places its components,
    `lora` serves per-row adapters, `controlnets` run in its calls, `cfg_parallel` splits the two CFG branches over
    two ranks. Each may also be handed over later (`use_residency`, `use_lora`, `use_controlnets`,
    `use_cfg_parallel`: the loader builds the recipe before the plan's residency and the process group exist)."""

    defers_decode = True
    """`run` is exactly `run_to_latents` + `decode_batch`, so a caller may run the two apart (the decode lane,
    `pipelines/lanes.py`)."""
    prefetches_text = True
    split_over_ranks = True
    lora: LoraBank | None = None
    """The adapters loaded at start-up in per-row slots of the denoiser (`lora/layers.py`, `use_lora`); None: none."""

    def __init__(
        self,
        adapter: AdapterBase,
        *,
        residency: Residency | None = None,
        lora: LoraBank | None = None,
        controlnets: Sequence[LoadedControlNet] = (),
        cfg_parallel: Any = None,
    ) -> None:
        super().__init__()
        self.adapter = adapter
        """The family's parts (`FamilyAdapter`): what this recipe drives."""
        self._take_facts(adapter)
        self._implemented = frozenset(name for name in OPTIONAL if callable(getattr(type(adapter), name, None)))
        """The optional parts the adapter implements; the recipe's default runs for the others."""
        self.text_stage = TextStage(self)
        """Step 1, encoding each distinct text once (and ahead of its batch, in the encode lane)."""
        adapter.recipe = self
        if residency is not None:
            self.use_residency(residency)
        if lora is not None:
            self.use_lora(lora)
        if controlnets:
            self.use_controlnets(controlnets)
        if cfg_parallel is not None:
            self.use_cfg_parallel(cfg_parallel)

    def _take_facts(self, adapter: AdapterBase) -> None:
        """Serve the checkpoint's facts (`adapter.facts`, the family spec applied to its configs) as this pipeline's
        settings: what the engine, the routes and the request checks read."""
        facts = adapter.facts
        if facts is None:
            raise TypeError(f"{type(adapter).__name__} has no checkpoint facts: call bind_facts in its constructor")
        self.family, self.facts = adapter.family, facts
        spec = self.spec
        self.output_kind, self.supports_batching = spec.output_kind, spec.supports_batching
        self.max_image_inputs, self.inpaints = spec.max_image_inputs, spec.inpaints
        self.packs_mixed_sizes, self.strength_per_row = spec.packs_mixed_sizes, spec.strength_per_row
        self.size_multiple, self.defaults = adapter.size_multiple, facts.defaults
        self.max_width, self.max_height = facts.max_width, facts.max_height
        self.supports_continuous = facts.supports_continuous
        self.batched_cfg = facts.cfg_batched
        """Run CFG as one doubled batch; tests may flip it on an instance."""
        self.guidance_rule = adapter.guidance_rule
        self.min_image_inputs, self.frame_multiple = adapter.min_image_inputs, adapter.frame_multiple
        self.supports_controlnet, self.audio_sample_rate = adapter.supports_controlnet, adapter.audio_sample_rate
        self.text_readings, self.family_facts, self.described = (
            adapter.text_readings,
            adapter.family_facts,
            adapter.described,
        )
        self.components, self.device, self.dtype = adapter.components, adapter.device, adapter.dtype
        self.denoisers = adapter.denoisers

    def tokenizer_part(self, key: str) -> Any:
        return self.adapter.component(key)

    def use_lora(self, bank: LoraBank) -> None:
        """Serve per-request LoRA: each batch's rows apply their own adapters from `bank` during the denoise."""
        self.lora = bank

    def lora_scope(self, batch: Sequence[SamplingParams]) -> contextlib.AbstractContextManager[None]:
        """Within: every row of `batch` applies its request's adapters (rows of a request, and both CFG
        branches, share them)."""
        if self.lora is None:
            named = next((p.lora for p in batch if p.lora), None)
            if named:
                raise ValueError(f"lora: {named[0][0]!r} is asked for but this pipeline has no adapters loaded")
            return contextlib.nullcontext()
        return self.lora.rows([p.lora for p in batch for _ in range(p.n)])

    # -- the adapter's parts (`FamilyAdapter`, pipelines/adapter.py), with the recipe's defaults ------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[SamplingParams]) -> Cond:
        return self.adapter.encode_text(key, texts, batch)

    def prepare(self, batch: Sequence[SamplingParams], head: SamplingParams, positive: Cond) -> DenoiseState:
        return self.adapter.prepare(batch, head, positive)

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        return self.adapter.predict(latents, timestep, cond, state, model_key)

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        return self.adapter.decode(latents, state)

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        if "preview" in self._implemented:
            return self.adapter.preview(latents, state)  # type: ignore[attr-defined]
        return self.decode(latents, state)

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: SamplingParams, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        if "combine_guidance" in self._implemented:
            return self.adapter.combine_guidance(cond, uncond, head, state, step_index)  # type: ignore[attr-defined]
        return combine_cfg(cond, uncond, self.cfg_scale(head))

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        if "step_extras" in self._implemented:
            return self.adapter.step_extras(states)  # type: ignore[attr-defined]
        return states[0].extras

    def extra_guidance(
        self,
        prediction: torch.Tensor,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        positive: Cond,
        negative: Cond | None,
        state: DenoiseState,
        step_index: int,
    ) -> torch.Tensor:
        if "extra_guidance" in self._implemented:
            extra = self.adapter.extra_guidance  # type: ignore[attr-defined]
            return extra(prediction, latents, timestep, positive, negative, state, step_index)
        return prediction

    def denoiser_for_step(self, step_index: int, timestep: torch.Tensor, state: DenoiseState) -> str:
        if "denoiser_for_step" in self._implemented:
            return self.adapter.denoiser_for_step(step_index, timestep, state)  # type: ignore[attr-defined]
        return self.adapter.denoisers[0]

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        if "scheduler_step" in self._implemented:
            return self.adapter.scheduler_step(noise_pred, timestep, latents, state)  # type: ignore[attr-defined]
        return state.scheduler.step(noise_pred, timestep, latents, return_dict=False)[0]

    def narrow_state(self, state: DenoiseState, index: torch.Tensor) -> DenoiseState:
        if "narrow_state" in self._implemented:
            return self.adapter.narrow_state(state, index)  # type: ignore[attr-defined]
        return state

    def packed_layout(self, groups: list[SizeGroup], positive: Cond) -> PackedRows:
        if "packed_layout" not in self._implemented:
            raise NotImplementedError(f"{type(self.adapter).__name__} does not pack mixed sizes")
        return self.adapter.packed_layout(groups, positive)  # type: ignore[attr-defined]

    def packed_extras(self, groups: list[SizeGroup], layout: PackedRows, positive: Cond) -> dict[str, Any]:
        if "packed_extras" in self._implemented:
            return self.adapter.packed_extras(groups, layout, positive)  # type: ignore[attr-defined]
        return {}

    # -- what the recipe decides from the adapter's facts ------------------------------------------------------

    def uses_cfg(self, head: SamplingParams) -> bool:
        """Whether the negative branch runs for `head`'s batch: the `guidance_rule` (the family spec's)."""
        return self.guidance_rule.runs(head)

    def cfg_scale(self, head: SamplingParams) -> float:
        """The guidance scale of `head`'s batch: the request field the `guidance_rule` names."""
        return self.guidance_rule.scale(head)

    def request_fields(self) -> frozenset[str]:
        """The spec's `peer_fields` and the checkpoint's `checkpoint_fields`, `flow_shift` with a shifting scheduler,
        `control_image` with ControlNets loaded."""
        control = ("control_image",) if self.controlnets else ()
        shift = ("flow_shift",) if has_flow_shift(self.adapter.scheduler) else ()
        return frozenset({*self.spec.peer_fields, *self.adapter.checkpoint_fields, *control, *shift})

    def prepare_components(self, head: SamplingParams) -> tuple[str, ...]:
        """Components `prepare` runs: `conditioning_components` for image-conditioned requests, else none."""
        return (self.adapter.decoder, *self.adapter.conditioning_components) if head.image_inputs else ()

    def packing_problem(self, head: SamplingParams, rows: Sequence[SamplingParams] = ()) -> str | None:
        """Why a mixed-size batch with `head`'s settings (and the per-row fields of `rows`) cannot run packed here
        (its size groups then run as separate calls), or None (`packing.packing_problem`)."""
        split = self.active_split() is not None
        return packing.packing_problem(head, rows, split=split, packs_split=self.adapter.packs_split)

    # -- the shared run ----------------------------------------------------------------------------------

    def encode_batch(self, batch: Sequence[SamplingParams], cfg: bool) -> tuple[Cond, Cond | None]:
        """Recipe step 1: the batch's conditioning, one row per output (and the negative one when `cfg`).

        Public: the continuous start (`pipelines/step_batch.py`) encodes joining requests with it."""
        return self.text_stage.encode_batch(batch, cfg)

    def prefetch_text(self, params: SamplingParams, on_done: Any = None) -> bool:
        """Dynamic batching: encode a queued text-only request's texts in the encode lane, beside the running
        batch (`pipelines/recipe_text.py`); its batch takes them. False when there was nothing to do."""
        return self.text_stage.prefetch(params, on_done)

    def guided_prediction(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        positive: Cond,
        negative: Cond | None,
        head: SamplingParams,
        state: DenoiseState,
        step_index: int,
        model_key: str,
        rows: Sequence[RowCache] | None = None,
    ) -> torch.Tensor:
        """Recipe step 3, one denoiser call: the prediction for `latents` at `timestep`, guided by the negative
        branch when there is one (CFG, or CFG parallel's split). Public: the continuous step calls it.

        `rows`: the step cache of each row (`step_cache/hooks.py`), or None when the rows run no cache; each
        row decides for itself whether the denoiser's blocks run for it at this step."""
        if rows is None:
            out = self._guided(latents, timestep, positive, negative, head, state, step_index, model_key)
        else:
            self.install_step_cache(model_key)
            for row in rows:
                row.use_denoiser(model_key)
            try:
                out = self._guided(
                    latents, timestep, positive, negative, head, state, step_index, model_key, list(rows)
                )
            finally:
                for row in rows:
                    row.end_step()
        return self.extra_guidance(out, latents, timestep, positive, negative, state, step_index)

    def _guided(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        positive: Cond,
        negative: Cond | None,
        head: SamplingParams,
        state: DenoiseState,
        step_index: int,
        model_key: str,
        cache: list[RowCache] | None = None,
    ) -> torch.Tensor:
        def predict(x: torch.Tensor, t: torch.Tensor, cond: Cond, branches: Sequence[int]) -> torch.Tensor:
            if cache is None:
                return self.predict(x, t, cond, state, model_key)
            from diffuserve.step_cache.hooks import CallRows, caching, rank_agreement

            packed = state.extras["packed"].layout if "packed" in state.extras else None  # pipelines/packing.py
            agreement = rank_agreement(self.active_split(), self.cfg_parallel, self.rank_parts)
            call = CallRows(cache * len(branches), [b for b in branches for _ in cache], agreement, packed)
            with caching(call):
                return self.predict(x, t, cond, state, model_key)

        if negative is None:
            return predict(latents, timestep, positive, (0,))
        if self.cfg_parallel is not None:
            # The split point for CFG parallel: each rank runs one branch (parallel/cfg_parallel.py).
            return self.cfg_parallel.guided(
                lambda cond: predict(latents, timestep, cond, (self.cfg_parallel.rank,)),
                positive,
                negative,
                lambda cond, uncond: self.combine_guidance(cond, uncond, head, state, step_index),
            )
        if self.batched_cfg:
            both = predict(
                torch.cat([latents, latents]),
                torch.cat([timestep, timestep]),
                concat_cond(positive, negative, self.adapter.masked_sequences),
                (0, 1),
            )
            cond, uncond = both.chunk(2)
        else:  # the conditional branch first: it decides for the row, the negative branch follows
            cond = predict(latents, timestep, positive, (0,))
            uncond = predict(latents, timestep, negative, (1,))
        return self.combine_guidance(cond, uncond, head, state, step_index)

    # -- step caches (step_cache/hooks.py) -------------------------------------------------------------

    def install_step_cache(self, model_key: str) -> None:
        """Hook denoiser `model_key`'s blocks for step caches (once, at first use)."""
        step_cache_hooks.install_hooks_on(self.adapter.component(model_key))

    def step_cache_problem(self, method: str) -> str | None:
        denoisers = [d for key in self.adapter.denoisers if (d := self.adapter.component(key)) is not None]
        return step_cache_hooks.method_problem(denoisers, method)

    def _denoise(
        self,
        state: DenoiseState,
        positive: Cond,
        negative: Cond | None,
        head: SamplingParams,
        on_step: StepCallback | None,
        should_stop: StopCheck | None,
        on_preview: PreviewCallback | None,
        batch: Sequence[SamplingParams],
        rows: list[RowCache] | None = None,
    ) -> torch.Tensor:
        latents = state.latents
        num_steps = len(state.timesteps)
        starts = inpaint_rows.row_starts(batch)
        with contextlib.ExitStack() as scope:
            active: str | None = None
            for i, t in enumerate(state.timesteps):
                model_key = self.denoiser_for_step(i, t, state)
                if model_key != active:
                    # Leave the previous denoiser's residency scope before entering the next, so only the
                    # active expert holds device memory (Wan2.2 A14B under component offload).
                    scope.close()
                    scope.enter_context(self.residency.use(model_key))
                    active = model_key
                call = (latents, t.expand(latents.shape[0]), positive, negative, head, state, i, model_key, rows)
                noise_pred = inpaint_rows.started_prediction(self, starts, *call)
                latents = inpaint_rows.keep_waiting(
                    self.scheduler_step(noise_pred, t, latents, state), latents, starts, i
                )
                if on_step is not None:
                    on_step(i, num_steps)
                if on_preview is not None:
                    current = latents
                    on_preview(i, num_steps, lambda current=current: self._previews(current, state, batch))
                # Checked after the step, never before the first: a cancel finishes the step in flight (or the
                # first one, when it lands during encoding), so "stopped at step k/N" is always the steps done
                # when the cancel landed plus one, the count `generate`'s Ctrl-C line prints.
                if should_stop is not None and should_stop():
                    raise RequestCancelledError(f"cancelled after denoising step {i + 1}/{num_steps}")
        return latents

    def _previews(self, latents: torch.Tensor, state: DenoiseState, batch: Sequence[SamplingParams]) -> list[list[Any]]:
        with torch.inference_mode(), self.decoder_scope():
            packed = "packed" in state.extras  # a mixed-size batch previews per size group (pipelines/packing.py)
            return rows_per_request(
                packing.previews(self, latents, state) if packed else self.preview(latents, state), batch
            )

    def decoder_scope(self) -> contextlib.AbstractContextManager[None]:
        """The decoder's residency scope, entered by one thread at a time (a decode may run in the decode lane
        while the loop makes a preview: `pipelines/lanes.py`)."""
        return lanes_for(self).decoder_scope(self.residency, self.adapter.decoder)

    def component_scope(self, key: str) -> contextlib.AbstractContextManager[None]:
        """`key`'s residency scope; the decoder's through `decoder_scope` (an edit's VAE encode in `prepare` may
        run while the decode lane decodes the previous batch with the same VAE)."""
        return self.decoder_scope() if key == self.adapter.decoder else self.residency.use(key)

    def run(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> BatchResult:
        return self.decode_batch(
            self.run_to_latents(batch, on_step=on_step, should_stop=should_stop, on_preview=on_preview)
        )

    def run_to_latents(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> Denoised:
        """Stages 1-3 of `run` (encode, latents, denoise); `decode_batch` is stage 4. Split so that the decode
        can run in the decode lane while the next batch denoises (`executor/batch_runner.py`,
        `pipelines/lanes.py`). A batch of several sizes runs packed where the family packs (`packing.py`)."""
        if self.packs_mixed_sizes and packing.mixed_sizes(batch):
            return packing_run.run_mixed(self, batch, on_step=on_step, should_stop=should_stop, on_preview=on_preview)
        if len(parts := split_runs.groups(batch, self.spec.run_apart_by)) > 1:
            return split_runs.run_apart(
                self, batch, parts, on_step=on_step, should_stop=should_stop, on_preview=on_preview
            )
        head = check_batch(batch, self.strength_per_row)
        cfg = self.uses_cfg(head)
        timer = StageTimer()
        with torch.inference_mode():
            # 1. Encode every distinct prompt (and negative prompt when CFG runs), one scope per encoder.
            with timer.stage("encode"):
                positive, negative = self.encode_batch(batch, cfg)
            # 2. Latents, schedule and per-batch extras (edits encode their input images here).
            with timer.stage("latents"), contextlib.ExitStack() as scope:
                for key in self.prepare_components(head):
                    scope.enter_context(self.component_scope(key))
                state = self.prepare(batch, head, positive)
            # 3. Denoise: the family's denoiser call(s), guidance, scheduler steps, cancellation.
            rows = batch_row_caches(batch, len(state.timesteps))
            with timer.stage("denoise"), self.lora_scope(batch):
                latents = self._denoise(state, positive, negative, head, on_step, should_stop, on_preview, batch, rows)
        return Denoised(batch=list(batch), latents=latents, state=state, stage_seconds=timer.seconds, row_caches=rows)

    def decode_batch(self, denoised: Denoised) -> BatchResult:
        """Stage 4 of `run`: decode, then split the rows back per request."""
        if "packed" in denoised.state.extras:
            return packing.decode_batch(self, denoised)
        if split_runs.PARTS in denoised.state.extras:
            return split_runs.decode_apart(self, denoised)
        timer = StageTimer()
        timer.seconds = dict(denoised.stage_seconds)
        with torch.inference_mode(), timer.stage("decode"), self.decoder_scope():
            decoded = self.decode(denoised.latents, denoised.state)
        return BatchResult(
            outputs=self.outputs_of(rows_per_request(decoded, denoised.batch), denoised), stage_seconds=timer.seconds
        )

    def outputs_of(self, rows: list[list[Any]], denoised: Denoised) -> list[RequestOutput]:
        """One RequestOutput per request from its decoded rows (and its rows' step-cache counts)."""
        caches = (
            rows_per_request(denoised.row_caches, denoised.batch)
            if denoised.row_caches
            else [None] * len(denoised.batch)
        )
        kind = "videos" if self.output_kind == "video" else "images"
        outputs = [RequestOutput(**{kind: r}, step_cache=step_counts(c)) for r, c in zip(rows, caches, strict=True)]
        audios = denoised.state.extras.pop("audios", None)  # sound, one waveform per row (`produces_audio`)
        for output, waves in zip(outputs, rows_per_request(audios, denoised.batch) if audios else (), strict=False):
            output.audios, output.audio_sample_rate = list(waves), self.audio_sample_rate
        return outputs
