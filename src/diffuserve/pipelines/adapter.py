"""What a native family adapter is: the `FamilyAdapter` protocol, read by an adapter author beside one family.

An adapter is a plain object: the checkpoint's loaded parts (`AdapterBase` holds them and the checkpoint's facts) and
the family's own steps. It inherits no behaviour of the recipe. The recipe (`pipelines/recipe.py`,
`RecipePipeline(adapter)`) is the one class that drives it, composed from the adapter and the serving parts handed to
it (residency, LoRA bank, ControlNets, CFG parallel, sequence split, lanes); it owns everything shared: the batch
signature, encoding each distinct text once, residency scopes, the CFG choice (two passes, one doubled batch, or CFG
parallel's two ranks), step caches, per-row LoRA, packing of mixed sizes, cancellation, progress and previews,
splitting rows back per request. Each method's docstring below says what it receives and what it returns. The facts
an adapter used to restate (output kind, sizes, defaults, text encoders, CFG as one doubled batch, continuous
batching) come from its family spec (`family_spec/<family>.py`) through `AdapterBase.bind_facts`; the tokenizers'
framing from `text_readings` (`pipelines/prompt_limits.py`).

Required: `encode_text`, `prepare`, `predict`, `decode`. Optional, with the recipe's default when absent from an
adapter: `preview` (a full decode), `combine_guidance` (the classic CFG combination), `extra_guidance` (none),
`step_extras` (the first request's extras), `scheduler_step` (the scheduler's step), `denoiser_for_step` (the only
denoiser), `narrow_state` (no per-row extras) and, for a family that packs mixed sizes (its spec's
`packs_mixed_sizes`), `packed_layout` / `packed_extras`. What used to be methods and is data now: the guidance rule,
the peer request fields and the fields that split a batch into runs (family spec `guidance`, `peer_fields`,
`run_apart_by`), the tokenizers' reading (`text_readings`), the checkpoint's facts for request checks and
/server_info (`family_facts`, `described`), the components an image-conditioned `prepare` runs
(`conditioning_components`), the sound's sample rate (`audio_sample_rate`). What an adapter asks of the recipe while
it runs (a component's residency scope, the loaded ControlNets, the sequence split) is the `RecipeServices` it is
handed as `adapter.recipe`.

`tests/unit/test_adapter_protocol.py` checks every native adapter against this protocol: its parts' signatures, that
it is no pipeline (no recipe method is inherited or overridden), and the guidance rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from diffuserve.family_spec.base import GuidanceRule

if TYPE_CHECKING:
    from diffuserve.family_spec.checkpoint import CheckpointFacts
    from diffuserve.pipelines.batch_rows import Cond, DenoiseState
    from diffuserve.pipelines.controlnet import LoadedControlNet
    from diffuserve.pipelines.packing import PackedRows, SizeGroup
    from diffuserve.pipelines.prompt_limits import TextReading
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


class RecipeServices(Protocol):
    """What an adapter may ask of the recipe that drives it (`adapter.recipe`, set by `RecipePipeline(adapter)`)."""

    controlnets: Mapping[str, LoadedControlNet]
    """The `--controlnet` models loaded for this pipeline, by name (empty: none)."""

    def component_scope(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Within: component `key` is placed for use (its residency scope; the decoder's is entered by one thread at
        a time). An adapter runs a component outside the recipe's own scopes through it (a ControlNet's image
        encode, LTX-2's audio decoder)."""
        ...

    def active_split(self) -> Any:
        """The sequence split while it is installed (`parallel/sequence.py`), else None: a packed call cuts its
        per-row positions to the rank's share."""
        ...


class AdapterBase:
    """The data every native adapter holds (no behaviour of the recipe): its loaded parts by model_index.json key, its
    device and dtype, and the checkpoint's facts. The family's class sets the class-level facts it has."""

    family: str = "unknown"
    """The family spec's name (`family_spec.spec_for(family)` gives the facts)."""
    text_encoders: tuple[str, ...] = ()
    """Component keys of the text encoders the checkpoint has, run in this order (`bind_facts`: the spec's)."""
    denoisers: tuple[str, ...] = ("transformer",)
    """Component keys of the denoiser(s), in the order `predict` is asked for them (Wan2.2: two experts)."""
    decoder: str = "vae"
    """Component key of the VAE that `decode` and `preview` run."""
    masked_sequences: Mapping[str, str] = {}
    """Variable-length text encodings: key of a padded sequence in `encode_text`'s output -> key of its mask
    (1 = token, 0 = padding). Rows are trimmed and padded through these when requests merge."""
    checkpoint_fields: frozenset[str] = frozenset()
    """Peer request fields this checkpoint adds to its family's (`request_fields`): Wan2.2's second expert's."""
    conditioning_components: tuple[str, ...] = ()
    """Components besides the decoder (whose encoder makes image latents) that `prepare` runs for an image-conditioned
    request, each entered in its residency scope by the recipe (Wan / HunyuanVideo 1.5 I2V: the image encoder)."""
    min_image_inputs: int = 0
    """Input images a request must carry (edits and image-to-video: 1)."""
    supports_controlnet: bool = False
    """`--controlnet` models run natively in this family's `prepare` / `predict`."""
    frame_multiple: int = 1
    """A video's frame count minus one must be a multiple of this (the VAE's temporal compression); 1: images."""
    audio_sample_rate: int | None = None
    """The sample rate of the sound `decode` returns (LTX-2); None: no sound."""
    packs_split: bool = False
    """Its packed call runs under sequence parallel, each row's positions cut to the rank's share (FLUX.1, Qwen)."""
    packing_call_tokens: float | None = None
    """A denoiser call's fixed cost in latent tokens, weighed against a packed call's padding (`pack_plan.py`);
    None: the device's default (`pack_plan.DEFAULT_CALL_TOKENS`); `math.inf`: always pack the whole batch."""
    text_readings: Mapping[str, TextReading] = {}
    """How the checkpoint's tokenizers read a prompt (tokenizer key -> `prompt_limits.TextReading`); empty: plainly."""
    family_facts: Mapping[str, Any] = {}
    """Plain-data facts of the checkpoint its family's request check reads (`FamilySpec.request_check`)."""
    described: Mapping[str, Any] = {}
    """Facts added to /server_info's description of the model (LTX-2's sound rate, Wan2.2's experts)."""
    guidance_rule: GuidanceRule = GuidanceRule()
    """When the negative branch runs and which field scales it: the family spec's (`bind_facts`); an adapter may
    narrow it for its checkpoint (a step-distilled FLUX.2 Klein never runs the negative branch)."""
    scheduler: Any = None
    """The checkpoint's scheduler (model_index.json `scheduler`), the template of each batch's private copy."""
    facts: CheckpointFacts | None = None
    """The checkpoint's facts (`family_spec.checkpoint.describe_checkpoint`), set by `bind_facts`."""
    recipe: RecipeServices
    """The recipe that drives this adapter, set by `RecipePipeline(adapter)`."""

    def __init__(self) -> None:
        self.components: dict[str, torch.nn.Module] = {}
        """model_index.json key -> module: what the residency manager places and the metrics count."""
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    @classmethod
    def from_components(cls, components: Mapping[str, Any], *, device: torch.device | str, dtype: torch.dtype) -> Any:
        """Build from the loader's model_index.json key -> loaded object mapping: the family spec's
        `required_components` as the constructor's keyword arguments (a CheckpointError names the missing ones). A
        family whose constructor reads more (optional parts, model_index.json settings) defines its own."""
        from diffuserve.family_spec.checkpoint import required_components

        return cls(**required_components(cls.family, components), device=device, dtype=dtype)

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this (the checkpoint's facts); 1: no rule."""
        if self.facts is None:
            return 1
        return self.facts.size_multiple or 1

    def bind_parts(self, parts: Mapping[str, Any], *, device: torch.device | str, dtype: torch.dtype) -> None:
        """Keep each loaded part as an attribute of its model_index.json key; the torch modules among them are the
        residency manager's `components`."""
        for key, part in parts.items():
            setattr(self, key, part)
        self.components = {key: part for key, part in parts.items() if isinstance(part, torch.nn.Module)}
        self.device = torch.device(device)
        self.dtype = dtype

    def bind_facts(self, configs: Mapping[str, Any]) -> CheckpointFacts:
        """Describe this checkpoint from its loaded parts' configs under the family spec: its `facts` (which the
        recipe serves from), its text encoders and the spec's guidance rule. Returns the facts."""
        from diffuserve.family_spec import spec_for
        from diffuserve.family_spec.checkpoint import describe_checkpoint

        spec = spec_for(self.family)
        facts = self.facts = describe_checkpoint(spec, configs)
        self.text_encoders = facts.text_encoders
        self.guidance_rule = spec.guidance
        return facts

    def component(self, key: str) -> Any:
        """The loaded part `key` (a module, tokenizer or processor), or None when the checkpoint has none."""
        return getattr(self, key, None)
