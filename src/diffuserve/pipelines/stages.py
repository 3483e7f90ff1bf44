"""The denoising recipe, once for every native family: `RecipePipeline.run`.

A family adapter (a `RecipePipeline` subclass) supplies only encode_text / prepare / predict (one denoiser
call) / decode, and where its family needs them its own guidance combine (Qwen-Image's norm-rescaled true
CFG) and a per-step choice of denoiser (Wan2.2's experts). The shared run owns the rest: checking the batch
signature, encoding each distinct text once and gathering one conditioning row per output, timing per stage,
residency scopes per stage and per denoiser, the CFG choice (two passes or one doubled batch), cancellation
between steps, progress and previews, and splitting the rows back per request.

Seeds: row `j` of a request (0 <= j < n) is drawn from its own CPU generator seeded with
`seed + j`. So a request's noise is the same whether it runs alone or merged with others, the same
on CPU and CUDA, and the diffusers backend (which takes one generator per output row) reproduces it.
For n == 1 this is exactly `diffusers` with `generator=torch.Generator().manual_seed(seed)`.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from diffuserve.errors import RequestCancelledError
from diffuserve.pipelines.base import (
    BatchResult,
    Pipeline,
    PreviewCallback,
    RequestOutput,
    StepCallback,
    StopCheck,
)
from diffuserve.pipelines.overlap import overlap_for

if TYPE_CHECKING:
    from PIL import Image

    from diffuserve.pipelines.text_prefetch import TextPrefetch
    from diffuserve.sampling import SamplingParams

T = TypeVar("T")

MAX_SEED = 2**63 - 1
"""Seeds are drawn below this so that `seed + j` still fits torch's 64-bit generator seed."""


# -- seeds and noise ------------------------------------------------------------------------------------


def resolve_seed(seed: int | None) -> int:
    """The seed to use: `seed` itself, or a fresh random one when the request left it unset."""
    if seed is None:
        return random.SystemRandom().randrange(MAX_SEED)
    return int(seed)


def row_seeds(params: SamplingParams, seed: int | None = None) -> list[int]:
    """The generator seeds of a request's `n` rows: `seed + j` for row j."""
    base = resolve_seed(params.seed if seed is None else seed)
    return [base + j for j in range(params.n)]


def row_generators(batch: Sequence[SamplingParams]) -> list[torch.Generator]:
    """One CPU generator per output row of the batch, in row order (request by request).

    CPU generators keep the noise identical across devices; diffusers' `randn_tensor` draws on the
    CPU and moves the result when the target device differs.
    """
    return [torch.Generator("cpu").manual_seed(s) for params in batch for s in row_seeds(params)]


def batch_noise(
    batch: Sequence[SamplingParams],
    row_shape: Sequence[int],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Initial noise of shape (rows, *row_shape): each row drawn from its own generator."""
    from diffusers.utils.torch_utils import randn_tensor

    generators = row_generators(batch)
    return randn_tensor((len(generators), *row_shape), generator=generators, device=device, dtype=dtype)


def check_batch(batch: Sequence[SamplingParams]) -> SamplingParams:
    """The batch's head, after checking it is non-empty and every request shares its signature.

    The scheduler only merges equal signatures; this catches a caller that did not, naming the
    field, instead of silently running every request with the head's settings.
    """
    from diffuserve.sampling import signature_difference

    if not batch:
        raise ValueError("a pipeline batch needs at least one request")
    head = batch[0]
    for i, params in enumerate(batch[1:], start=1):
        diff = signature_difference(head, params)
        if diff is not None:
            raise ValueError(
                f"request {i} of the batch differs from request 0 in {diff}; it cannot share the call"
            )
    return head


def num_rows(batch: Sequence[SamplingParams]) -> int:
    """Rows of the batch: the sum of every request's `n`."""
    return sum(params.n for params in batch)


def repeat_per_row(tensor: torch.Tensor, batch: Sequence[SamplingParams]) -> torch.Tensor:
    """Expand one entry per request (dim 0) to one per output row (request i repeated n_i times)."""
    counts = [params.n for params in batch]
    if all(c == 1 for c in counts):
        return tensor
    return tensor.repeat_interleave(torch.tensor(counts, device=tensor.device), dim=0)


def split_rows(rows: Sequence[T], batch: Sequence[SamplingParams]) -> list[list[T]]:
    """Split per-row outputs back per request: request i owns the next n_i rows."""
    if len(rows) != num_rows(batch):
        raise ValueError(f"cannot split {len(rows)} outputs over requests that own {num_rows(batch)} rows")
    out: list[list[T]] = []
    start = 0
    for params in batch:
        out.append(list(rows[start : start + params.n]))
        start += params.n
    return out


# -- classifier-free guidance ---------------------------------------------------------------------------


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The CFG combination, in the operand order diffusers uses (so results match bit for bit)."""
    return uncond + scale * (cond - uncond)


# -- the loop's helpers -----------------------------------------------------------------------------------


def has_flow_shift(scheduler: Any) -> bool:
    """Whether `scheduler` is a flow-matching scheduler with a sigma shift a request's `flow_shift` can set:
    FlowMatchEuler's `shift`, or `flow_shift` of a multistep solver over flow sigmas (Wan's UniPC)."""
    config = scheduler.config
    return "shift" in config or ("flow_shift" in config and bool(config.get("use_flow_sigmas", False)))


def scheduler_template(scheduler: Any, flow_shift: float | None) -> Any:
    """A new scheduler from the checkpoint's config; with `flow_shift`, its static shift is that value and dynamic
    (resolution-dependent) shifting is off, as SGLang-Diffusion and FastVideo apply their `flow_shift`."""
    if flow_shift is None:
        return scheduler.__class__.from_config(scheduler.config)
    key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
    return scheduler.__class__.from_config(scheduler.config, **{key: flow_shift, "use_dynamic_shifting": False})


def fresh_scheduler(template: Any) -> Any:
    """A private copy of a scheduler whose timesteps are already set.

    The cached template (and its timestep tensors) are never mutated by a run.
    """
    # A deep copy: multistep solvers (UniPC, DPM-Solver++) keep their history in lists they update in place,
    # which a shallow copy would share with the cached template (tiny objects: a few tensors of `steps` floats).
    scheduler = copy.deepcopy(template)
    scheduler._step_index = None
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    return scheduler


class StageTimer:
    """Collects wall time per named stage for BatchResult.stage_seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


# -- conditioning rows --------------------------------------------------------------------------------------

Cond = dict[str, torch.Tensor]
"""A batch's conditioning: named tensors, each with one row per output on dim 0."""


def pad_to(tensor: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """`tensor` zero-padded along `dim` to `length` (masks pad with 0 = ignored)."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def gather_rows(encoded: Cond, index: torch.Tensor, masked: dict[str, str] | None = None) -> Cond:
    """Rows `index` of every tensor. `masked` maps a sequence key to its attention-mask key: trailing columns
    that every selected row pads are cut (to the longest selected text), so a row sees the same sequence
    whether or not longer texts shared its encoder call."""
    rows = {k: v.index_select(0, index.to(v.device)) for k, v in encoded.items()}
    for seq_key, mask_key in (masked or {}).items():
        mask = rows[mask_key]
        length = int(mask.sum(dim=1).max().item()) if mask.numel() else 0
        if length < mask.shape[1]:
            rows[seq_key] = rows[seq_key][:, :length]
    for mask_key in set((masked or {}).values()):
        mask = rows[mask_key]
        length = int(mask.sum(dim=1).max().item()) if mask.numel() else 0
        rows[mask_key] = mask[:, :length]
    return rows


def concat_cond(a: Cond, b: Cond, masked: dict[str, str] | None = None) -> Cond:
    """Two conditionings stacked on dim 0 (batched CFG); masked sequences of different lengths are padded
    (their masks mark the padding)."""
    padded = set(masked or {}) | set((masked or {}).values())
    out: Cond = {}
    for key in a:
        x, y = a[key], b[key]
        if key in padded and x.shape[1] != y.shape[1]:
            length = max(x.shape[1], y.shape[1])
            x, y = pad_to(x, length), pad_to(y, length)
        out[key] = torch.cat([x, y])
    return out


@dataclass
class DenoiseState:
    """What `prepare` hands the loop: the starting latents, the schedule, and per-batch extras."""

    latents: torch.Tensor
    """Initial latents, one row per output."""
    timesteps: torch.Tensor
    """The timesteps to run, in order."""
    scheduler: Any
    """A private scheduler for this batch (`fresh_scheduler`)."""
    extras: dict[str, Any]
    """Per-batch values the adapter's predict/decode need (position ids, guidance vector, image latents)."""


# -- the recipe ---------------------------------------------------------------------------------------------


class RecipePipeline(Pipeline):
    """Base class of every native family: implements `run` once; subclasses implement the family parts."""

    text_encoders: tuple[str, ...] = ()
    """Component keys of the text encoders, run in this order, each in its own residency scope."""
    denoisers: tuple[str, ...] = ("transformer",)
    """Component keys of the denoiser(s); `denoiser_for_step` picks one per step."""
    decoder: str = "vae"
    """Component key that `decode` runs."""
    masked_sequences: dict[str, str] = {}
    """Variable-length text encoders: `encode_text` output key of a padded sequence -> key of its attention
    mask (1 = token, 0 = padding). Rows are trimmed and padded through these when requests merge."""
    batched_cfg: bool = False
    """Run CFG as one doubled batch instead of two passes (diffusers runs two passes)."""
    cfg_parallel: Any = None
    """A `parallel.cfg_parallel.CfgParallel` when the two CFG branches run on two ranks; None in one process."""
    prefetches_text = True
    split_over_ranks = True
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

    # -- family parts ------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[SamplingParams]) -> Cond:
        """Encode `texts` (the batch's distinct texts) with text encoder `key`: one row per text."""
        raise NotImplementedError

    def uses_cfg(self, head: SamplingParams) -> bool:
        """Whether the unconditional branch runs (default: true CFG, `true_cfg_scale > 1` with a negative prompt)."""
        return head.cfg_enabled

    def cfg_scale(self, head: SamplingParams) -> float:
        """The CFG scale (default `true_cfg_scale`; families with classic CFG use `guidance_scale`)."""
        return head.true_cfg_scale

    def prepare_components(self, head: SamplingParams) -> tuple[str, ...]:
        """Components `prepare` runs (the VAE encoder for image-conditioned requests)."""
        return (self.decoder,) if head.image_inputs else ()

    def prepare(self, batch: Sequence[SamplingParams], head: SamplingParams, positive: Cond) -> DenoiseState:
        """Initial latents (noise row j of a request from `seed + j`), timesteps, scheduler and extras."""
        raise NotImplementedError

    def predict(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState,
                model_key: str) -> torch.Tensor:
        """One call of denoiser `model_key`; `timestep` is the raw scheduler timestep, one per row."""
        raise NotImplementedError

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, head: SamplingParams,
                         state: DenoiseState, step_index: int) -> torch.Tensor:
        """The guided prediction from the two branches (default: the classic CFG combination)."""
        return combine_cfg(cond, uncond, self.cfg_scale(head))

    def denoiser_for_step(self, step_index: int, timestep: torch.Tensor, state: DenoiseState) -> str:
        """Which denoiser runs this step (default: the only one)."""
        return self.denoisers[0]

    def scheduler_step(self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor,
                       state: DenoiseState) -> torch.Tensor:
        return state.scheduler.step(noise_pred, timestep, latents, return_dict=False)[0]

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        """Final latents -> one PIL image (or list of frames, for video) per row."""
        raise NotImplementedError

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        """A cheap image per row of the current latents (default: a full decode)."""
        return self.decode(latents, state)

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
            parts = [ready.get(t) or {k: v[fresh[t]:fresh[t] + 1] for k, v in encoded.items()} for t in unique]
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
        with overlap_for(self).encoder_lock:
            for key in self.text_encoders:
                with self.residency.use(key):
                    encoded.update(self.encode_text(key, texts, batch))
        return encoded

    def _encode_rows(self, texts: list[str], params: SamplingParams) -> list[Cond]:
        """`texts` (of queued requests sharing `params`' signature) through each text encoder in one call, cut
        back to one one-row conditioning per text (masked sequences trimmed to the text's own length)."""
        encoded = self._encode_texts(texts, [params])
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

    def guided_prediction(self, latents: torch.Tensor, timestep: torch.Tensor, positive: Cond, negative: Cond | None,
                          head: SamplingParams, state: DenoiseState, step_index: int, model_key: str) -> torch.Tensor:
        """Recipe step 3, one denoiser call: the prediction for `latents` at `timestep`, guided by the negative
        branch when there is one (CFG, or CFG parallel's split). Public: the continuous step calls it."""
        if negative is None:
            return self.predict(latents, timestep, positive, state, model_key)
        if self.cfg_parallel is not None:
            # The split point for CFG parallel: each rank runs one branch (parallel/cfg_parallel.py).
            return self.cfg_parallel.guided(
                lambda cond: self.predict(latents, timestep, cond, state, model_key), positive, negative,
                lambda cond, uncond: self.combine_guidance(cond, uncond, head, state, step_index))
        if self.batched_cfg:
            both = self.predict(torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                                concat_cond(positive, negative, self.masked_sequences), state, model_key)
            cond, uncond = both.chunk(2)
        else:
            cond = self.predict(latents, timestep, positive, state, model_key)
            uncond = self.predict(latents, timestep, negative, state, model_key)
        return self.combine_guidance(cond, uncond, head, state, step_index)

    def _denoise(self, state: DenoiseState, positive: Cond, negative: Cond | None, head: SamplingParams,
                 on_step: StepCallback | None, should_stop: StopCheck | None,
                 on_preview: PreviewCallback | None, batch: Sequence[SamplingParams]) -> torch.Tensor:
        latents = state.latents
        num_steps = len(state.timesteps)
        with contextlib.ExitStack() as scope:
            active: str | None = None
            for i, t in enumerate(state.timesteps):
                if should_stop is not None and should_stop():
                    raise RequestCancelledError(f"cancelled before denoising step {i + 1}/{num_steps}")
                model_key = self.denoiser_for_step(i, t, state)
                if model_key != active:
                    # Leave the previous denoiser's residency scope before entering the next, so only the
                    # active expert holds device memory (Wan2.2 A14B under component offload).
                    scope.close()
                    scope.enter_context(self.residency.use(model_key))
                    active = model_key
                timestep = t.expand(latents.shape[0])
                noise_pred = self.guided_prediction(latents, timestep, positive, negative, head, state, i, model_key)
                latents = self.scheduler_step(noise_pred, t, latents, state)
                if on_step is not None:
                    on_step(i, num_steps)
                if on_preview is not None:
                    current = latents
                    on_preview(i, num_steps, lambda current=current: self._previews(current, state, batch))
        return latents

    def _previews(self, latents: torch.Tensor, state: DenoiseState, batch: Sequence[SamplingParams]) -> list[list[Any]]:
        with torch.inference_mode(), self.decoder_scope():
            return split_rows(self.preview(latents, state), batch)

    def decoder_scope(self) -> contextlib.AbstractContextManager[None]:
        """The decoder's residency scope, entered by one thread at a time (a decode may run in the decode lane
        while the loop makes a preview: `pipelines/overlap.py`)."""
        return overlap_for(self).decoder_scope(self.residency, self.decoder)

    @property
    def defers_decode(self) -> bool:
        """Whether `run` is exactly `run_to_latents` + `decode_batch`, so a caller may run the two apart (a family
        that wraps `run` around per-request state, like Qwen-Image-Edit, keeps it whole)."""
        return type(self).run is RecipePipeline.run

    def component_scope(self, key: str) -> contextlib.AbstractContextManager[None]:
        """`key`'s residency scope; the decoder's through `decoder_scope` (an edit's VAE encode in `prepare` may
        run while the decode lane decodes the previous batch with the same VAE)."""
        return self.decoder_scope() if key == self.decoder else self.residency.use(key)

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        """The extras of one continuous step over several requests' states (`pipelines/step_batch.py`).

        Default: the first one's, which the continuous group key makes equal to the others' (same size and
        guidance). A family whose extras count rows overrides this."""
        return states[0].extras

    def run(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> BatchResult:
        return self.decode_batch(self.run_to_latents(batch, on_step=on_step, should_stop=should_stop,
                                                     on_preview=on_preview))

    def run_to_latents(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> Denoised:
        """Stages 1-3 of `run` (encode, latents, denoise); `decode_batch` is stage 4. Split so that the decode
        can run in the decode lane while the next batch denoises (`executor/worker.py`, `pipelines/overlap.py`)."""
        head = check_batch(batch)
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
            with timer.stage("denoise"):
                latents = self._denoise(state, positive, negative, head, on_step, should_stop, on_preview, batch)
        return Denoised(batch=list(batch), latents=latents, state=state, stage_seconds=timer.seconds)

    def decode_batch(self, denoised: Denoised) -> BatchResult:
        """Stage 4 of `run`: decode, then split the rows back per request."""
        timer = StageTimer()
        timer.seconds = dict(denoised.stage_seconds)
        with torch.inference_mode(), timer.stage("decode"), self.decoder_scope():
            decoded = self.decode(denoised.latents, denoised.state)
        rows = split_rows(decoded, denoised.batch)
        if self.output_kind == "video":
            outputs = [RequestOutput(videos=r) for r in rows]
        else:
            outputs = [RequestOutput(images=r) for r in rows]
        return BatchResult(outputs=outputs, stage_seconds=timer.seconds)


@dataclass
class Denoised:
    """A batch after its denoising loop (`run_to_latents`), before its decode (`decode_batch`)."""

    batch: list[SamplingParams]
    latents: torch.Tensor
    """The final latents, one row per output."""
    state: DenoiseState
    stage_seconds: dict[str, float]
    """Seconds of the stages run so far."""


def to_pil_images(images: torch.Tensor) -> list[Image.Image]:
    """(rows, 3, H, W) in [-1, 1] -> PIL images, with the rounding diffusers' image processor uses."""
    from PIL import Image

    array = (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    array = (array * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in array]
