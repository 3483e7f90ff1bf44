"""What a native family adapter implements: the `FamilyAdapter` protocol, read by an adapter author beside one family.

The recipe (`pipelines/recipe.py`) owns everything shared: the batch signature, encoding each distinct text once,
residency scopes, the CFG choice (two passes, one doubled batch, or CFG parallel's two ranks), step caches,
per-row LoRA, packing of mixed sizes, cancellation, progress and previews, splitting rows back per request. An
adapter supplies the family's own parts below and nothing else; each method's docstring says what it receives
and what it returns. The facts an adapter used to restate (output kind, sizes, defaults, text encoders, CFG as
one doubled batch, continuous batching) come from its family spec (`family_spec/<family>.py`) through
`bind_facts`; the tokenizers' framing from `text_readings` (`pipelines/prompt_limits.py`).

Required: `encode_text`, `prepare`, `predict`, `decode`. Optional, with the recipe's default when absent from an
adapter: `preview` (a full decode), `combine_guidance` (the classic CFG combination), `extra_guidance` (none),
`step_extras` (the first request's extras), `scheduler_step` (the scheduler's step), `denoiser_for_step` (the only
denoiser), `narrow_state` (no per-row extras) and, for a family that packs mixed sizes (its spec's
`packs_mixed_sizes`), `packed_layout` / `packed_extras`. What used to be methods and is data now: the guidance rule,
the peer request fields and the fields that split a batch into runs (family spec `guidance`, `peer_fields`,
`run_apart_by`), the tokenizers' reading (`text_readings`), the checkpoint's facts for request checks and
/server_info (`family_facts`, `described`), the components an image-conditioned `prepare` runs
(`conditioning_components`), the sound's sample rate (`audio_sample_rate`).

`tests/unit/test_adapter_protocol.py` checks every native adapter against this protocol and keeps the list of the
recipe's other methods an adapter overrides from growing (today: none; Hunyuan3D, a mesh family, runs its own loop
and is no recipe adapter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from diffuserve.pipelines.batch_rows import Cond, DenoiseState
    from diffuserve.pipelines.packing import PackedRows, SizeGroup
    from diffuserve.sampling import SamplingParams

REQUIRED = ("encode_text", "prepare", "predict", "decode")
"""The parts every native adapter implements."""
OPTIONAL = (
    "preview",
    "combine_guidance",
    "extra_guidance",
    "step_extras",
    "scheduler_step",
    "denoiser_for_step",
    "narrow_state",
    "packed_layout",
    "packed_extras",
)
"""The parts an adapter may implement; the recipe's default runs otherwise."""


@runtime_checkable
class FamilyAdapter(Protocol):
    """The family parts the recipe drives (one batch: encode, prepare, one predict per step and branch, decode)."""

    family: str
    """The family spec's name (`family_spec.spec_for(family)` gives the facts)."""
    denoisers: tuple[str, ...]
    """Component keys of the denoiser(s), in the order `predict` is asked for them (Wan2.2: two experts)."""
    decoder: str
    """Component key of the VAE that `decode` and `preview` run."""
    masked_sequences: dict[str, str]
    """Variable-length text encodings: key of a padded sequence in `encode_text`'s output -> key of its mask
    (1 = token, 0 = padding). Rows are trimmed and padded through these when requests merge."""

    def encode_text(self, key: str, texts: list[str], batch: Sequence[SamplingParams]) -> Cond:
        """Encode `texts` with text encoder `key` (one of the spec's text encoders, called in their order, each inside
        its residency scope). `texts` are the batch's distinct prompts and negative prompts; `batch` is the requests
        they come from (for per-family rules such as SANA's role-dependent framing).

        Returns one row per text: name -> tensor of shape (len(texts), ...); padded sequences named in
        `masked_sequences` with their masks. The recipe gathers one row per output from it."""
        ...

    def prepare(self, batch: Sequence[SamplingParams], head: SamplingParams, positive: Cond) -> DenoiseState:
        """The batch's starting point: latents (row j of a request from the generator of `seed + j`:
        `recipe.batch_noise`), the timesteps to run, a private scheduler, and `extras` (position ids, guidance
        vector, image latents of edits) that `predict` / `decode` read. `head` is the first request (the batch
        signature makes the others alike in what `prepare` reads); `positive` is the conditioning, one row per
        output. Image-conditioned requests encode their images here (inside the decoder's scope)."""
        ...

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        """One call of denoiser `model_key` on `latents` (rows, ...) at `timestep` (the raw scheduler timestep, one
        per row) under `cond` (one branch's conditioning, one row per latent row). Returns the model output in the
        scheduler's convention, shaped like `latents`. Per-row LoRA, step caches and the sequence split act inside
        the call through the row context (`runtime/row_context.py`); the adapter does not see them."""
        ...

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        """Final latents -> one output per row: a PIL image, or a list of frames for video (LTX-2 also sound)."""
        ...


class OptionalParts(Protocol):
    """The parts an adapter may implement; the recipe runs the default each docstring names when it does not."""

    def preview(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        """A cheap image per row of the current latents, for streamed previews. Default: `decode` (a video's middle
        frame is enough; FLUX.1 decodes its x0 estimate)."""
        ...

    def combine_guidance(
        self, cond: torch.Tensor, uncond: torch.Tensor, head: SamplingParams, state: DenoiseState, step_index: int
    ) -> torch.Tensor:
        """The guided prediction from the two branches' outputs at step `step_index`. Default: classic CFG,
        `uncond + scale * (cond - uncond)` (Qwen-Image rescales by the norm; LTX-2 adds its other passes)."""
        ...

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
        """The step's prediction from the recipe's guided one (`prediction`: `combine_guidance`'s result under CFG,
        else the conditional branch), with passes of the family's own beyond CFG on `latents` at `timestep` under
        `positive` (the conditional text). Default: `prediction` unchanged (LTX-2 adds its STG and modality-isolation
        passes and combines in x0 space; its `combine_guidance` hands both branches on)."""
        ...

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        """Continuous batching: the `extras` of one step over several requests' states, stacked into one call
        (`pipelines/step_batch.py`). Default: the first one's (the group key makes them equal); a family whose
        extras are per row (ControlNet images, LTX-2's per-row sigmas, SANA's row count) merges them."""
        ...

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        """The latents after one step from `latents` at `timestep` with the model output `noise_pred` (the guided
        prediction). Default: `state.scheduler.step`. A family adds what diffusers does around it (a masked edit puts
        the kept region back; FLUX.1 keeps the velocity for its preview)."""
        ...

    def denoiser_for_step(self, step_index: int, timestep: torch.Tensor, state: DenoiseState) -> str:
        """The component key of the denoiser that runs step `step_index` (at `timestep`). Default: the only one
        (Wan2.2 A14B switches experts at its boundary)."""
        ...

    def narrow_state(self, state: DenoiseState, index: torch.Tensor) -> DenoiseState:
        """The state a denoiser call on rows `index` only sees (edits of several strengths, where some rows have not
        started: `pipelines/inpaint.py`): extras holding one value per row cut to those rows. Default: unchanged."""
        ...

    def packed_layout(self, groups: list[SizeGroup], positive: Cond) -> PackedRows:
        """Packed mixed sizes: each row's text and latent tokens in the one padded call over `groups` (the batch's
        size groups) under `positive` (`pipelines/packing.py`)."""
        ...

    def packed_extras(self, groups: list[SizeGroup], layout: PackedRows, positive: Cond) -> dict[str, Any]:
        """Packed mixed sizes: the extras of the packed state that `predict` reads (per-row position ids, ...).
        Default: none."""
        ...
