"""The denoising recipe, once for every native family: `RecipePipeline.run`.

A family adapter supplies only the parts of the `FamilyAdapter` protocol (`pipelines/adapter.py`): encode_text /
prepare / predict (one denoiser call) / decode, and where its family needs them the optional ones (its own guidance
combine, a per-step choice of denoiser, packing). The shared run owns the rest: checking the batch signature,
encoding each distinct text once and gathering one conditioning row per output, timing per stage, residency scopes
per stage and per denoiser, the CFG choice (two passes or one doubled batch), cancellation between steps, progress
and previews, and splitting the rows back per request.

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
from diffuserve.pipelines.base import (
    BatchResult,
    Pipeline,
    PreviewCallback,
    RequestOutput,
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
from diffuserve.step_cache.hooks import RowCache, step_counts
from diffuserve.step_cache.rows import batch_row_caches

if TYPE_CHECKING:
    from diffuserve.lora.layers import LoraBank
    from diffuserve.pipelines.text_prefetch import TextPrefetch
    from diffuserve.sampling import SamplingParams

T = TypeVar("T")

# -- the recipe ---------------------------------------------------------------------------------------------


class RecipePipeline(packing.PackedFamily, Pipeline):
    """Base class of every native family: implements `run` once; subclasses implement the family parts."""

    text_encoders: tuple[str, ...] = ()
    """Component keys of the text encoders, run in this order, each in its own residency scope."""
    denoisers: tuple[str, ...] = ("transformer",)
    """Component keys of the denoiser(s); `denoiser_for_step` picks one per step."""
    decoder: str = "vae"
    """Component key that `decode` runs."""
    checkpoint_fields: frozenset[str] = frozenset()
    """Peer request fields this checkpoint adds to its family's (`request_fields`): Wan2.2's second expert's."""
    conditioning_components: tuple[str, ...] = ()
    """Components besides the decoder (whose encoder makes image latents) that `prepare` runs for an image-conditioned
    request, each entered in its residency scope by the recipe (Wan / HunyuanVideo 1.5 I2V: the image encoder)."""
    masked_sequences: dict[str, str] = {}
    """Variable-length text encoders: `encode_text` output key of a padded sequence -> key of its attention
    mask (1 = token, 0 = padding). Rows are trimmed and padded through these when requests merge."""
    scheduler: Any = None
    """The checkpoint's scheduler (model_index.json `scheduler`), the template of each batch's private copy."""
    defers_decode = True
    """`run` is exactly `run_to_latents` + `decode_batch` (no adapter overrides `run`: test_adapter_protocol.py), so a
    caller may run the two apart (the decode lane, `pipelines/lanes.py`)."""
    prefetches_text = True
    split_over_ranks = True
    lora: LoraBank | None = None
    """The adapters loaded at start-up in per-row slots of the denoiser (`lora/layers.py`, `use_lora`); None: none."""
    _text_prefetch: TextPrefetch | None = None
    """Texts encoded in the encode lane ahead of their batch (`prefetch_text`); made on first use."""

    def bind_parts(self, parts: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype) -> None:
        """Keep each loaded part as an attribute of its model_index.json key; the torch modules among them are
        the residency manager's `components`."""
        for key, part in parts.items():
            setattr(self, key, part)
        self.components = {key: part for key, part in parts.items() if isinstance(part, torch.nn.Module)}
        self.device = torch.device(device)
        self.dtype = dtype

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

    # -- family parts: the `FamilyAdapter` protocol (pipelines/adapter.py) and the recipe's defaults -------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[SamplingParams]) -> Cond:
        raise NotImplementedError  # FamilyAdapter.encode_text

    def prepare(self, batch: Sequence[SamplingParams], head: SamplingParams, positive: Cond) -> DenoiseState:
        raise NotImplementedError  # FamilyAdapter.prepare

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        raise NotImplementedError  # FamilyAdapter.predict

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        raise NotImplementedError  # FamilyAdapter.decode

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        return self.decode(latents, state)  # OptionalParts.preview's default

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: SamplingParams, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        return combine_cfg(cond, uncond, self.cfg_scale(head))  # OptionalParts.combine_guidance's default

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        return states[0].extras  # OptionalParts.step_extras' default

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
        return prediction  # OptionalParts.extra_guidance's default: the guided prediction as it is

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
        shift = ("flow_shift",) if has_flow_shift(self.scheduler) else ()
        return frozenset({*self.spec.peer_fields, *self.checkpoint_fields, *control, *shift})

    def prepare_components(self, head: SamplingParams) -> tuple[str, ...]:
        """Components `prepare` runs: `conditioning_components` for image-conditioned requests, else none."""
        return (self.decoder, *self.conditioning_components) if head.image_inputs else ()

    def denoiser_for_step(self, step_index: int, timestep: torch.Tensor, state: DenoiseState) -> str:
        return self.denoisers[0]  # OptionalParts.denoiser_for_step's default: the only one

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        return state.scheduler.step(noise_pred, timestep, latents, return_dict=False)[0]

    # -- the shared run ----------------------------------------------------------------------------------

    def encode_batch(self, batch: Sequence[SamplingParams], cfg: bool) -> tuple[Cond, Cond | None]:
        """Recipe step 1: the batch's conditioning, one row per output (and the negative one when `cfg`).

        Public: the continuous start (`pipelines/step_batch.py`) encodes joining requests with it."""
        # Each distinct text is encoded once (negative prompts in the same encoder calls), then gathered to
        # one row per output: request i's row repeated n_i times, as diffusers does for num_images_per_prompt.
        texts = [p.prompt for p in batch]
        if cfg:
            texts += [p.negative_prompt or "" for p in batch]
        unique = list(dict.fromkeys(texts))
        prefetch = self._text_prefetch
        ready = {t: c for t in unique if prefetch is not None and (c := prefetch.take(t, batch[0])) is not None}
        missing = [t for t in unique if t not in ready]
        encoded = self._encode_texts(missing, batch) if missing else {}
        if ready:  # texts encoded in the lane while the previous batch denoised (pipelines/text_prefetch.py)
            fresh = {t: i for i, t in enumerate(missing)}
            parts = [ready.get(t) or {k: v[fresh[t] : fresh[t] + 1] for k, v in encoded.items()} for t in unique]
            encoded = parts[0]
            for part in parts[1:]:
                encoded = concat_cond(encoded, part, self.masked_sequences)
        slot = {text: i for i, text in enumerate(unique)}
        counts = [p.n for p in batch]

        def rows(part: list[str]) -> Cond:
            index = torch.tensor([slot[t] for t, n in zip(part, counts, strict=True) for _ in range(n)])
            return gather_rows(encoded, index, self.masked_sequences)

        k = len(batch)
        return rows(texts[:k]), (rows(texts[k:]) if cfg else None)

    def _encode_texts(self, texts: list[str], batch: Sequence[SamplingParams]) -> Cond:
        """`texts` through every text encoder, one row each. One encode at a time (a tokenizer is not
        thread-safe): the encode lane and a request-level batch on the loop's thread may both get here."""
        encoded: Cond = {}
        with lanes_for(self).encoder_lock:
            for key in self.text_encoders:
                with self.residency.use(key):
                    encoded.update(self.encode_text(key, texts, batch))
        return encoded

    def _encode_rows(self, texts: list[str], requests: list[SamplingParams]) -> list[Cond]:
        """`texts` (of the queued `requests`, which share one signature) through each text encoder in one call,
        cut back to one one-row conditioning per text (masked sequences trimmed to the text's own length)."""
        encoded = self._encode_texts(texts, requests)
        return [gather_rows(encoded, torch.tensor([i]), self.masked_sequences) for i in range(len(texts))]

    def prefetch_text(self, params: SamplingParams, on_done: Any = None) -> bool:
        """Dynamic batching: encode a queued text-only request's texts in the encode lane, beside the running
        batch (`pipelines/text_prefetch.py`); its batch takes them. False when there was nothing to do."""
        if params.image_inputs:  # image-conditioned text encoders read the images too
            return False
        from diffuserve.pipelines.text_prefetch import TextPrefetch

        if self._text_prefetch is None:  # the engine's admission calls this under its lock: made once
            self._text_prefetch = TextPrefetch(self, self._encode_rows)
        prefetch = self._text_prefetch
        texts = [params.prompt] + ([params.negative_prompt or ""] if self.uses_cfg(params) else [])
        return prefetch.submit(params, texts, on_done)

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
                concat_cond(positive, negative, self.masked_sequences),
                (0, 1),
            )
            cond, uncond = both.chunk(2)
        else:  # the conditional branch first: it decides for the row, the negative branch follows
            cond = predict(latents, timestep, positive, (0,))
            uncond = predict(latents, timestep, negative, (1,))
        return self.combine_guidance(cond, uncond, head, state, step_index)

    # -- step caches (step_cache/hooks.py) -------------------------------------------------------------

    def step_cache_containers(self, model_key: str) -> tuple[str, ...]:
        """Attribute names of denoiser `model_key`'s repeated blocks: its class' layer containers in the family
        spec's layer table (`family_spec/*.py`)."""
        from diffuserve.family_spec import layer_rules
        from diffuserve.step_cache.hooks import model_class

        denoiser = getattr(self, model_key, None)
        rules = layer_rules().get(model_class(denoiser).__name__, ())
        return tuple(path for path, _count in rules)

    def install_step_cache(self, model_key: str) -> None:
        """Hook denoiser `model_key`'s blocks for step caches (once, at first use)."""
        from diffuserve.step_cache.hooks import install_hooks

        install_hooks(getattr(self, model_key), self.step_cache_containers(model_key))

    def step_cache_problem(self, method: str) -> str | None:
        from diffuserve.family_spec import step_cache_rules
        from diffuserve.step_cache.hooks import cache_rules, supports_blocks

        for key in self.denoisers:
            denoiser = getattr(self, key, None)
            if denoiser is None:
                continue
            problem = supports_blocks(denoiser, self.step_cache_containers(key))
            if problem is not None:
                return problem
            if method == "teacache" and not cache_rules(denoiser).teacache_coefficients:
                return (
                    f"teacache needs published rescale coefficients for {type(denoiser).__name__}; they exist for "
                    f"{sorted(k for k, r in step_cache_rules().items() if r.teacache_coefficients)} (FLUX.1); use "
                    "fbcache or taylorseer here"
                )
        return None

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

    def narrow_state(self, state: DenoiseState, index: torch.Tensor) -> DenoiseState:
        return state  # OptionalParts.narrow_state's default: no extras hold one value per row

    def _previews(self, latents: torch.Tensor, state: DenoiseState, batch: Sequence[SamplingParams]) -> list[list[Any]]:
        with torch.inference_mode(), self.decoder_scope():
            packed = "packed" in state.extras  # a mixed-size batch previews per size group (pipelines/packing.py)
            return rows_per_request(
                packing.previews(self, latents, state) if packed else self.preview(latents, state), batch
            )

    def decoder_scope(self) -> contextlib.AbstractContextManager[None]:
        """The decoder's residency scope, entered by one thread at a time (a decode may run in the decode lane
        while the loop makes a preview: `pipelines/lanes.py`)."""
        return lanes_for(self).decoder_scope(self.residency, self.decoder)

    def component_scope(self, key: str) -> contextlib.AbstractContextManager[None]:
        """`key`'s residency scope; the decoder's through `decoder_scope` (an edit's VAE encode in `prepare` may
        run while the decode lane decodes the previous batch with the same VAE)."""
        return self.decoder_scope() if key == self.decoder else self.residency.use(key)

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
