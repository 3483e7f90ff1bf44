"""The contract between the worker and a pipeline (native family adapter or the diffusers backend).

The worker hands a pipeline a list of `SamplingParams` (one per request of a batch) and gets back, per request, its
`n` outputs. Everything model-specific lives behind this interface."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from diffuserve.family_spec.base import FamilySpec, GuidanceRule, SamplingDefaults
from diffuserve.pipelines.capabilities import Capabilities
from diffuserve.pipelines.results import BatchResult as BatchResult  # re-exported: the family adapters import it here
from diffuserve.pipelines.results import RequestOutput as RequestOutput

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from diffuserve.activation import ActivationFacts
    from diffuserve.family_spec.checkpoint import CheckpointFacts
    from diffuserve.family_spec.request_rules import RequestRules
    from diffuserve.family_spec.text_tokens import EncoderLimit
    from diffuserve.lora.layers import LoraBank
    from diffuserve.pipelines.controlnet import LoadedControlNet
    from diffuserve.pipelines.lanes import Lanes
    from diffuserve.pipelines.prompt_limits import PromptTokens, TextReading
    from diffuserve.sampling import ModelDescription, SamplingParams


def declared_sequence_length(tokenizer: Any, default: int) -> int:
    """`default`, capped by the tokenizer's declared `model_max_length` (the longest text the checkpoint
    was made for; real FLUX.1 declares 512, so it gets diffusers' default unchanged)."""
    declared = getattr(tokenizer, "model_max_length", None)
    return min(default, int(declared)) if isinstance(declared, int) and declared > 0 else default


def component_configs(components: Mapping[str, Any], model_index: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `family_spec.base.CheckpointConfigs` of loaded components: each one's config (diffusers' FrozenDict, or
    transformers' config as a dict), plus the checkpoint's model_index.json when given."""
    configs: dict[str, Any] = {}
    for key, value in components.items():
        config = getattr(value, "config", None)
        if isinstance(config, Mapping):
            configs[key] = dict(config)
        elif callable(getattr(config, "to_dict", None)):
            configs[key] = config.to_dict()
    if model_index is not None:
        configs["model_index"] = dict(model_index)
    return configs


class Residency(Protocol):
    """Residency hook point: a pipeline wraps each stage in `use(component)`.

    The residency manager (runtime/residency.py) implements it and moves weights on/off the device as the
    deployment plan says; the default does nothing (everything resident)."""

    in_compile_warmup: bool
    """True while `compile_warmup()` is entered (a replica's leader tells its other ranks to place the same)."""

    def use(self, component: str) -> contextlib.AbstractContextManager[None]: ...

    def compile_warmup(self) -> contextlib.AbstractContextManager[None]:
        """Placement while the engine's compile warm-up runs (`--offload-during-compile`)."""
        ...


class AllResident:
    """Default residency: every component stays where the loader put it."""

    in_compile_warmup = False

    @contextlib.contextmanager
    def use(self, component: str) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def compile_warmup(self) -> Iterator[None]:
        yield


StepCallback = Callable[[int, int], None]
"""on_step(step_index, num_steps): called after each denoising step."""

StopCheck = Callable[[], bool]
"""should_stop(): checked between steps; True raises RequestCancelledError out of the loop."""

PreviewCallback = Callable[[int, int, Callable[[], list[list["Image.Image"]]]], None]
"""on_preview(step_index, num_steps, make_previews): called after each denoising step of a native pipeline;
`make_previews()` returns, per request of the batch, one preview image per output row (computed only when
called, so steps nobody wants a preview of cost nothing)."""


_LANES_LOCK = threading.Lock()


class Pipeline:
    """Base class of every pipeline. Subclasses implement `run` and declare their capabilities."""

    family: str = "unknown"
    output_kind: Literal["image", "video", "mesh"] = "image"
    supports_batching: bool = True
    """False for families whose requests must run alone (dynamic batching treats them as ineligible)."""
    supports_continuous: bool = False
    """Whether `--batching-mode continuous` may step this pipeline's requests in a shared denoise group: the
    family spec's `supports_continuous` for a native adapter (`RecipePipeline`); False falls back to request-level
    batching (the diffusers backend)."""
    packs_mixed_sizes: bool = False
    """Rows of different sizes may share one call: the spec's fact (native); False for the diffusers backend."""
    strength_per_row: bool = False
    """Edits of different strengths may share one call: the family spec's `strength_per_row` (`RecipePipeline`)."""
    size_multiple: int = 1
    """Width/height must be multiples of this: the checkpoint's (native or the diffusers backend's); 1: none."""
    max_pixels: int = 4096 * 4096
    backend: str = "native"
    """native | diffusers: which backend runs the checkpoint (the diffusers backend has its own request checks)."""
    denoisers: tuple[str, ...] = ()
    """Component keys of the native denoiser(s) that per-row LoRA slots, tensor parallel and FSDP act on (the
    recipe's `("transformer",)`, Wan2.2's two experts); (): none (the diffusers backend runs its own)."""
    supports_controlnet: bool = False
    """Runs ControlNets handed over by `use_controlnets` (the native FLUX.1, SD3 and Qwen-Image adapters)."""
    controlnets: Mapping[str, LoadedControlNet] = {}
    """The loaded ControlNets by name (`use_controlnets`); none by default."""
    max_width: int | None = None
    """Largest width the checkpoint's positional tables allow (None: no limit of the model's own)."""
    max_height: int | None = None
    """Largest height the checkpoint's positional tables allow (None: no limit of the model's own)."""
    max_image_inputs: int = 0
    """Input images one request may carry (edits); 0: this model takes none."""
    min_image_inputs: int = 0
    """Input images every request must carry (1 for edit-only models); warm-up sends this many."""
    inpaints: bool = False
    """Edits may carry a mask (`SamplingParams.mask_input`): the family spec's `inpaint` task, for a native adapter
    (`RecipePipeline`); the diffusers backend runs no masks."""
    frame_multiple: int = 1
    """Video: num_frames - 1 must divide by this (the VAE's temporal compression)."""
    defaults: SamplingDefaults = SamplingDefaults()
    audio_sample_rate: int | None = None
    """Samples per second of the sound a `produces_audio` family's outputs carry (the adapter's vocoder rate)."""
    defers_decode: bool = False
    """Whether `run` is exactly `run_to_latents` + `decode_batch` (the native recipe says so per family)."""
    prefetches_text: bool = False
    """Whether `prefetch_text` can encode a queued request's texts beside the running batch."""
    split_over_ranks: bool = False
    """Whether the denoising loop is the native recipe's, which the parallel strategies can split over ranks."""
    batched_cfg: bool = False
    """Run CFG as one doubled batch instead of two passes (such families refuse CFG parallel)."""
    cfg_parallel: Any = None
    """The CFG-parallel strategy (`parallel/cfg_parallel.CfgParallel`) once `use_cfg_parallel` set it; None: one."""
    sequence_parallel: Any = None
    """The sequence split (`parallel/sequence.SequenceParallel`), set by `enable_sequence_parallel`; None: none."""
    rank_parts: tuple[Any, ...] = ()
    """Weight-sharding strategies (TP, FSDP) whose ranks agree on step-cache measures (`agree_over`)."""
    _lanes: Lanes | None = None
    """The encode and decode side lanes (`pipelines/lanes.py`), made on first use by `lanes()`."""
    _prompt_tokens_lock = threading.Lock()
    """Builds each pipeline's `PromptTokens` once (its tokenizer copies are made once per loaded model)."""
    family_facts: Mapping[str, Any] = {}
    """The checkpoint's own facts its family's request check reads (`FamilySpec.request_check`), set by the adapter
    from its checkpoint (Wan2.2's two experts, a distilled Klein, Qwen-Image 2.1's prompt template); plain data."""
    described: Mapping[str, Any] = {}
    """Facts of this checkpoint for /server_info and the start-up log beyond the common ones (`describe`)."""
    text_readings: Mapping[str, TextReading] = {}
    """Per model_index tokenizer key, how the adapter gives texts to that encoder beyond what the tokenizer declares
    (`prompt_limits.TextReading`: a cap of its own, a chat-template framing); empty: as declared."""
    _prompt_tokens_owner: PromptTokens | None = None
    """The built `PromptTokens` (None until `prompt_tokens()` first runs)."""

    guidance_rule: GuidanceRule = GuidanceRule()
    """Its classifier-free guidance: the family spec's rule (`RecipePipeline`); an adapter may narrow it for its
    checkpoint (a step-distilled FLUX.2 Klein never runs the negative branch)."""
    facts: CheckpointFacts | None = None
    """A native adapter's checkpoint facts (`family_spec.checkpoint.describe_checkpoint`), taken by `RecipePipeline`."""

    @property
    def spec(self) -> FamilySpec:
        """This pipeline's family spec (the generic one for a family no spec lists)."""
        from diffuserve.family_spec import spec_for

        try:
            return spec_for(self.family)
        except KeyError:
            return spec_for("generic")

    def __init__(self) -> None:
        self.residency: Residency = AllResident()
        self.components: dict[str, torch.nn.Module] = {}
        """model_index.json key -> module, for residency and metrics."""
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None

    @property
    def capabilities(self) -> Capabilities:
        """What this pipeline can do (from its declared class facts)."""
        return Capabilities(
            batching=self.supports_batching,
            continuous=self.supports_continuous,
            packs_mixed_sizes=self.packs_mixed_sizes,
            strength_per_row=self.strength_per_row,
            continuous_key_fields=self.spec.continuous_key_fields,
            defers_decode=self.defers_decode,
            text_prefetch=self.prefetches_text,
            split_over_ranks=self.split_over_ranks,
            cfg_parallel=self.split_over_ranks and not self.batched_cfg,
        )

    def use_residency(self, residency: Residency) -> None:
        """Place components through `residency` from now on (built by `launch/setup.py` from the plan)."""
        self.residency = residency

    def use_cfg_parallel(self, strategy: Any) -> None:
        """Run the two CFG branches of every step through `strategy` (`parallel/cfg_parallel.py`)."""
        from diffuserve.errors import ConfigError

        if not self.capabilities.cfg_parallel:
            raise ConfigError(
                f"--enable-cfg-parallel: the {self.family} model cannot split its CFG branches over "
                "two ranks; leave it off for this model.",
                param="enable_cfg_parallel",
            )
        self.cfg_parallel = strategy

    def use_lora(self, bank: LoraBank) -> None:
        """Serve per-request LoRA from `bank`'s per-row slots in `denoisers` (`lora/slots.py`): the native recipe
        does; the base refuses."""
        raise self._no_lora()

    def load_lora_adapters(self, adapters: dict[str, str]) -> None:
        """Load start-up adapters (name -> path), one adapter set per call, into a pipeline without `denoisers`:
        the diffusers backend does; the base refuses."""
        raise self._no_lora()

    def _no_lora(self) -> Exception:
        from diffuserve.errors import ConfigError

        return ConfigError(
            f"--lora-modules: the {self.family} pipeline on this backend takes no per-row adapters (the diffusers "
            "backend takes start-up --lora-modules only, one adapter set per call); serve it on the native backend "
            "or drop the flag."
        )

    def use_controlnets(self, loaded: Sequence[LoadedControlNet]) -> None:
        """`--controlnet`: run `loaded` (family-checked by `models/controlnets.py`) from now on. Each is a component
        the residency plan places (handed over before residency is built) and an attribute of its key, like the
        checkpoint's own parts. A pipeline without `supports_controlnet` refuses, naming the flag."""
        from diffuserve.errors import ConfigError

        if not self.supports_controlnet:
            raise ConfigError(
                f"--controlnet: the {self.family} model is served by a pipeline that runs no ControlNet "
                f"({type(self).__name__}); ControlNets run natively for FLUX.1, SD3 and Qwen-Image (--backend native).",
                param="controlnet",
            )
        self.controlnets = {c.name: c for c in loaded}
        for c in loaded:
            self.components[c.key] = c.model
            setattr(self, c.key, c.model)

    def agree_over(self, part: Any) -> None:
        """Let `part`'s ranks agree on step-cache measures (`parallel/agreement.py`); same order on every rank."""
        self.rank_parts = (*self.rank_parts, part)

    def active_split(self) -> Any:
        """The sequence split while its hooks are installed, else None."""
        return self.sequence_parallel if self.sequence_parallel is not None and self.sequence_parallel.handles else None

    def lanes(self) -> Lanes:
        """This pipeline's encode and decode side lanes (`pipelines/lanes.py`), made once, on its device."""
        with _LANES_LOCK:
            if self._lanes is None:
                from diffuserve.pipelines.lanes import Lanes

                self._lanes = Lanes(self.device or "cpu")
            return self._lanes

    def prefetch_text(self, params: SamplingParams, on_done: Callable[[int], None] | None = None) -> bool:
        """Encode a queued request's texts beside the running batch; False: this pipeline cannot (the default)."""
        return False

    def request_rules(self) -> RequestRules:
        """The facts a request is checked against, as plain data (`family_spec.request_rules.RequestRules`): derived
        once here, in the engine's process, and carried by the model's description, so any process checks a
        request with `family_spec.request_rules.validate_request` and never calls this pipeline."""
        from diffuserve.config.step_cache import METHODS
        from diffuserve.family_spec.request_rules import RequestRules

        problems = self.__dict__.get("_step_cache_problems")  # asked once: the routes describe the model per request
        if problems is None:
            problems = {m: p for m in METHODS if (p := self.step_cache_problem(m)) is not None}
            self.__dict__["_step_cache_problems"] = problems
        return RequestRules(
            family=self.family,
            output_kind=self.output_kind,
            backend=self.backend,
            size_multiple=self.size_multiple,
            max_width=self.max_width,
            max_height=self.max_height,
            max_pixels=self.max_pixels,
            max_image_inputs=self.max_image_inputs,
            min_image_inputs=self.min_image_inputs,
            inpaints=self.inpaints,
            frame_multiple=self.frame_multiple,
            step_cache_problems=problems,
            facts=self.request_facts(),
        )

    def request_facts(self) -> dict[str, Any]:
        """The checkpoint's own facts its family's request check reads (`FamilySpec.request_check`), plain data: the
        loaded ControlNets' Union mode counts by name and the adapter's `family_facts`."""
        nets = self.controlnets
        loaded = {"controlnets": {name: net.num_modes for name, net in nets.items()}} if nets else {}
        return {**loaded, **self.family_facts}

    def validate(self, params: SamplingParams) -> None:
        """`validate_request` (`family_spec/request_rules.py`) against this pipeline's rules (for tools and tests in the
        engine's process; the routes check against the description's copy of the rules)."""
        from diffuserve.family_spec.request_rules import validate_request

        owner = self.prompt_tokens()
        validate_request(params, self.request_rules(), owner.tokens)

    def step_cache_problem(self, method: str) -> str | None:
        """Why this pipeline cannot run step-cache `method` (None: it can). Native families answer from their
        denoiser's blocks (`recipe.RecipePipeline`); other pipelines run no step cache."""
        return "only native families run step caches (this pipeline runs through the diffusers backend)"

    def run(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> BatchResult:
        """Run one batch as one pipeline call; returns the outputs per request, in order. `on_preview` is
        honoured by pipelines that can preview (native families); others ignore it."""
        raise NotImplementedError

    def request_fields(self) -> frozenset[str]:
        """The peer request fields (`sampling.PEER_FIELDS`) this model gives meaning to; the base: none."""
        return frozenset()

    @property
    def produces_audio(self) -> bool:
        """Its videos carry sound (`RequestOutput.audios`): the family spec's `produces_audio`."""
        return self.spec.produces_audio

    def describe_model(self) -> ModelDescription:
        """What the routes and the request builder need to know (`diffuserve.sampling.ModelDescription`)."""
        from diffuserve.sampling import ModelDescription

        encoders, usage = self._prompt_table()
        return ModelDescription(
            family=self.family,
            output_kind=self.output_kind,
            defaults=self.defaults,
            size_multiple=self.size_multiple,
            max_image_inputs=self.max_image_inputs,
            min_image_inputs=self.min_image_inputs,
            inpaints=self.inpaints,
            frame_multiple=self.frame_multiple,
            supports_batching=self.supports_batching,
            packs_mixed_sizes=self.packs_mixed_sizes,
            max_width=self.max_width,
            max_height=self.max_height,
            rules=self.request_rules(),
            text_encoders=encoders,
            usage_encoder=usage,
            request_fields=self.request_fields(),
            produces_audio=self.produces_audio,
            activation=self._activation_facts(),
        )

    def _prompt_table(self) -> tuple[tuple[EncoderLimit, ...], EncoderLimit | None]:
        """`prompt_tokens().table()`, derived once (the routes describe the model on every request)."""
        cached = self.__dict__.get("_described_prompt_table")
        if cached is None:
            cached = self.__dict__["_described_prompt_table"] = self.prompt_tokens().table()
        return cached

    def _activation_facts(self) -> ActivationFacts:
        """`activation_facts()`, derived once (the routes describe the model on every request)."""
        cached = self.__dict__.get("_activation")
        if cached is None:
            cached = self.__dict__["_activation"] = self.activation_facts()
        return cached

    def activation_facts(self) -> ActivationFacts:
        """What the activation-memory estimate knows about this checkpoint (`diffuserve/activation.py`), from the
        loaded components' configs; pipelines whose work is not a DiT + VAE (meshes) override it."""
        from diffuserve.activation import activation_facts

        return activation_facts(
            self.output_kind,
            component_configs(self.components),
            size_multiple=self.size_multiple,
            dtype_bytes=self.dtype.itemsize if self.dtype is not None else 4,
            frame_multiple=self.frame_multiple,
        )

    # -- prompt tokens: what the server counts (pipelines/prompt_limits.py) ------------------------------------

    def tokenizer_part(self, key: str) -> Any:
        """The loaded model_index part `key` (a tokenizer or a processor), or None when the checkpoint has none.
        Adapters keep parts as attributes of their key; the diffusers backend keeps them on its `.pipe`."""
        part = getattr(self, key, None)
        return part if part is not None else getattr(getattr(self, "pipe", None), key, None)

    def prompt_tokens(self) -> PromptTokens:
        """THE owner of this model's prompt token counts, built once from its tokenizers (private copies) and its
        `text_readings` (`prompt_limits.checkpoint_counter`)."""
        from diffuserve.pipelines.prompt_limits import checkpoint_counter

        with Pipeline._prompt_tokens_lock:
            if self._prompt_tokens_owner is None:
                self._prompt_tokens_owner = checkpoint_counter(self.family, self.tokenizer_part, self.text_readings)
            return self._prompt_tokens_owner

    def describe(self) -> dict[str, Any]:
        """Facts for /server_info and the start-up log."""
        return {
            "family": self.family,
            "output_kind": self.output_kind,
            "supports_batching": self.supports_batching,
            "size_multiple": self.size_multiple,
            "max_size": [self.max_width, self.max_height],
            "max_image_inputs": self.max_image_inputs,
            "produces_audio": self.produces_audio,
            "components": sorted(self.components),
            # Prompt tokens each text encoder reads (null: the whole prompt). Asking builds the token owner, so
            # the engine's start-up log (in its own thread, at load) makes the private tokenizer copies.
            "text_encoders": {limit.encoder: limit.max_tokens for limit in self.prompt_tokens().limits},
            **self.described,
        }
