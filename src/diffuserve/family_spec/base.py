"""The shape of a family spec: every fact about one model family, in one place.

A family is what a diffusers pipeline class (model_index.json `_class_name`) stands for: FLUX.1, Qwen-Image,
Wan2.1 ... Its spec is read by the registry (which family, which backend), the model profiles (plan
thresholds, layer containers), the runtime (layer-wise tables), `make-tiny` (its tiny builders), and the
request builder (default sampling values). Nothing here imports torch: `diffuserve plan` and `--help` stay fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

LayerCount = str | Callable[[dict[str, Any]], int] | None
"""How many layers a container holds: a config.json key (looked up under `text_config` too), a function of
the config, or None (count the indices in the safetensors header)."""

LayerRules = dict[str, tuple[tuple[str, LayerCount], ...]]
"""model class name -> (module-list path or path suffix, its layer count), in execution order."""


@dataclass(frozen=True)
class StepCacheRules:
    """How the step caches (`step_cache/hooks.py`) cut one DiT class beyond its layer containers."""

    chained: bool = False
    """Its layer containers form one chain (each block takes the previous block's hidden states, across
    containers: FLUX.1), so the cache narrows them all. False: only the last container's blocks chain (FLUX.2 joins
    the text and image streams before its single blocks; Z-Image's refiners run on other token sets)."""
    teacache_coefficients: tuple[float, ...] = ()
    """The published TeaCache rescale polynomial of this DiT, highest power first; empty: `teacache` is refused."""
    teacache_input: Callable[[Any, Any, dict[str, Any]], Any] | None = None
    """TeaCache's block-input rule: (first block, its hidden states, its bound arguments) -> the timestep-modulated
    input whose change decides (FLUX.1: the block's `norm1` with `temb`)."""


OutputKind = Literal["image", "video", "mesh"]

CheckpointConfigs = Mapping[str, Mapping[str, Any]]
"""A checkpoint's configs, read without weights: model_index.json key -> that component's config.json
(scheduler_config.json for a scheduler), plus "model_index" -> model_index.json itself. `diffuserve plan` reads
them from the folder (`family_spec.checkpoint.read_checkpoint_configs`); an adapter from its loaded modules."""


@dataclass(frozen=True)
class LatentGeometry:
    """How a checkpoint maps pixels to DiT tokens (a pure function of its VAE and transformer configs)."""

    vae_factor: int
    """Pixels per latent pixel (the VAE's spatial compression)."""
    patch: int
    """Latent pixels per token side (the DiT's patch, or FLUX's 2x2 packing)."""

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: one token's side in pixels."""
        return self.vae_factor * self.patch

    def snap(self, pixels: int) -> int:
        """`pixels` rounded down to the size multiple (at least one token)."""
        return max(self.size_multiple, int(pixels) // self.size_multiple * self.size_multiple)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for fields it leaves unset (the diffusers pipeline's own call defaults for the
    published checkpoint). An adapter may refine them from the loaded checkpoint (a tiny VAE's sample size)."""

    width: int = 1024
    """Output width in pixels."""
    height: int = 1024
    """Output height in pixels."""
    num_inference_steps: int = 28
    """Denoising steps."""
    guidance_scale: float = 3.5
    """Guidance scale as the diffusers pipeline uses it (embedded guidance or CFG, per family)."""
    true_cfg_scale: float = 1.0
    """True classifier-free guidance scale (Qwen-Image, FLUX.1 with a negative prompt); 1 = off."""
    negative_prompt: str | None = None
    """Negative prompt used when a request gives none (None: no negative branch unless the family's CFG
    always runs, in which case the empty string is its unconditional text)."""
    num_frames: int = 1
    """Frames per output (1 for image families)."""
    fps: int = 16
    """Frames per second of an encoded video."""
    guidance_scale_2: float | None = None
    """Guidance scale of the low-noise expert (Wan2.2 A14B); None = same as guidance_scale."""
    octree_resolution: int = 0
    """Mesh families: grid cells per side of the decoded volume (the checkpoint's; 0 for other families)."""


@dataclass(frozen=True)
class ProfileFacts:
    """What the deployment plan's modes know about a family (thresholds live here, not in the resolver)."""

    dit_resident_threshold_gib: float | None = 45.0
    """`auto` keeps the DiT resident when every selected GPU has at least this much free. None: `auto` never
    makes the DiT resident on its own (video: frames and resolution move the peak too much for one figure)."""
    vae_resident_threshold_gib: float = 24.0
    """`auto` keeps VAE-like components resident only with this much free per GPU."""
    large_encoder_gib: float = 2.0
    """Text/image encoders at least this large are `large auxiliary encoders`: layer-wise under `auto`
    when the DiT is resident, so the encoder's whole-component onload does not sit beside the DiT."""
    comfortable_fit_fraction: float = 0.8
    """`auto` below the DiT threshold uses component offload when the DiT takes at most this share of
    the free memory, and layer-wise offload (where supported) when it does not fit comfortably."""
    default_uses_cfg: bool = False
    """The family's default sampling runs classifier-free guidance (two branches per step)."""
    fsdp_can_replace_dit_offload: bool = False
    """Multi-GPU `auto` may shard the DiT with FSDP instead of offloading it (validated families only)."""
    dit_supports_layerwise: bool = False
    """The presets (`auto` below threshold, `memory`) may pick layer-wise offload for the DiT."""
    compile_validated: bool = False
    """torch.compile has a validated path for this family, so `auto`/`speed`/`memory` turn it on."""
    sequence_parallel: bool = False
    """The native DiT has a sequence split, so `--ulysses-degree` / `--ring-degree` run for it (start-up
    refuses them for families without one, naming the flag)."""
    tensor_parallel: bool = False
    """The native DiT has a tensor-parallel plan, so `--tp-size` runs for it."""


GuidanceTrigger = Literal["true_cfg", "true_cfg_given_negative", "above_one", "not_one", "above_zero", "never"]
"""When the unconditional (negative) branch runs, as the family's diffusers pipeline decides:
- `true_cfg`: the scale > 1 and a non-empty negative prompt (FluxPipeline, QwenImagePipeline);
- `true_cfg_given_negative`: the scale > 1 and a negative prompt given, "" included (QwenImageEditPipeline);
- `above_one`: the scale > 1 (SANA, SD3, Wan, FLUX.2 Klein); `not_one`: the scale != 1 (HunyuanVideo 1.5);
- `above_zero`: the scale > 0 (Z-Image); `never`: guidance-distilled, no negative branch (FLUX.2-dev)."""


@dataclass(frozen=True)
class GuidanceRule:
    """Classifier-free guidance of a family: which request field is its scale and when the negative branch runs."""

    scale_field: Literal["true_cfg_scale", "guidance_scale"] = "true_cfg_scale"
    """The request field that scales the guidance (`combine_guidance` reads it; FLUX.1 and Qwen-Image keep
    `guidance_scale` for the embedded guidance of distilled checkpoints)."""
    runs_when: GuidanceTrigger = "true_cfg"
    """When the negative branch runs (see `GuidanceTrigger`)."""
    audio_scale: float | None = None
    """A joint audio-video family's guidance scale of the sound (LTX-2's, diffusers' default): while a request
    generates sound, the negative branch also runs when it is above 1. None: the family makes no sound."""

    def scale(self, params: Any) -> float:
        """The guidance scale of a request (`SamplingParams`)."""
        return float(getattr(params, self.scale_field))

    def runs(self, params: Any) -> bool:
        """Whether a request's (`SamplingParams`) negative branch runs: the batch's rows double when it does."""
        scale = self.scale(params)
        if self.audio_scale is not None and self.audio_scale > 1.0 and params.generate_audio is not False:
            return True
        trigger = self.runs_when
        if trigger == "true_cfg":
            return scale > 1.0 and bool(params.negative_prompt)
        if trigger == "true_cfg_given_negative":
            return scale > 1.0 and params.negative_prompt is not None
        if trigger == "not_one":
            return not math.isclose(scale, 1.0)
        if trigger == "above_zero":
            return scale > 0.0
        return trigger == "above_one" and scale > 1.0


@dataclass(frozen=True)
class TextEncoderFacts:
    """One text encoder a prompt goes through, and how much of the prompt it reads (the server warns about,
    or with `--reject-truncated-prompts` refuses, a prompt longer than that: `pipelines/prompt_limits.py`)."""

    tokenizer: str
    """model_index.json key of the encoder's tokenizer (`tokenizer_2`), or of a processor holding one
    (`processor`: Qwen-Image 2.1 and the edit models)."""
    label: str
    """Name shown to users, e.g. `text_encoder_2 (T5)`."""
    max_tokens: int | None
    """Tokens of the prompt (special tokens included) the published pipeline reads, its `max_sequence_length`
    default; the rest is cut off. At load it is capped by the length the checkpoint's tokenizer declares
    (`model_max_length`), as the pipelines cap their own. None: the pipeline reads the whole prompt (no cut)."""


@dataclass(frozen=True)
class FamilySpec:
    """Every fact about one model family. One instance per family, in `family_spec/<family>.py`.

    Static facts only, and checkpoint-dependent ones as small pure functions of the checkpoint's configs
    (`latent_geometry`, `checkpoint_defaults`, `max_latent_side`): `family_spec.checkpoint.describe_checkpoint` applies
    them, for `diffuserve plan` (no weights) and for the loaded adapter alike."""

    name: str
    """Family name used everywhere (`flux`, `qwen_image`, `wan` ...)."""
    pipeline_classes: tuple[str, ...] = ()
    """diffusers pipeline class names (model_index.json `_class_name`) of this family."""
    model_id_patterns: tuple[str, ...] = ()
    """Regexes tried on the lower-cased `--model-id` when the class name is not one we know."""
    id_priority: int = 0
    """Higher is tried first among model-id patterns (a variant such as `qwen-image-edit` before `qwen-image`)."""
    output_kind: OutputKind = "image"
    """image | video | mesh."""
    tasks: frozenset[str] = frozenset({"t2i"})
    """What it does: t2i, i2i (edits), inpaint (edits with a `mask`, natively), t2v, i2v."""
    native_adapter: str | None = None
    """"module:Class" of the native pipeline adapter; None runs the diffusers backend."""
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """Request defaults of the published checkpoint."""
    profile: ProfileFacts = field(default_factory=ProfileFacts)
    """Deployment-plan facts."""
    layer_containers: LayerRules = field(default_factory=dict)
    """Layer table rows of this family's own model classes (its DiT); shared encoder and VAE classes are
    in `family_spec/components.py`."""
    step_cache_rules: dict[str, StepCacheRules] = field(default_factory=dict)
    """DiT class name -> how step caches cut it beyond its layer containers; a class not listed: defaults."""
    size_multiple: int | None = None
    """Width and height must be multiples of this: the diffusers pipeline class's own input check, for a family
    whose figure is not a rule of its configs (LTX-2: 32 whatever its VAE). None: `latent_geometry` decides (native
    families), or the diffusers backend derives it from the loaded pipeline."""
    latent_geometry: Callable[[CheckpointConfigs], LatentGeometry] | None = None
    """The size-multiple rule: VAE factor and patch from the checkpoint's configs (`describe_checkpoint`)."""
    checkpoint_defaults: Callable[[SamplingDefaults, CheckpointConfigs, LatentGeometry], SamplingDefaults] | None = None
    """Variants and sizes read from the configs: `defaults` refined for this checkpoint (FLUX.1 schnell's 4 steps
    without guidance when its transformer has no guidance embedding; a default size from the VAE's sample size)."""
    max_latent_side: Callable[[dict[str, Any]], int | tuple[int, int] | None] | None = None
    """Positional limit of the DiT: from its config.json, the longest side in latent pixels (before patching)
    its position tables cover, or a (height, width) pair where the axes differ (Z-Image), or None for no table
    limit (RoPE computed on the fly). Pixel limit = this x the VAE's spatial factor; larger sizes are a 400
    naming `size` before queueing, not an error inside the model."""
    max_image_inputs: int = 0
    """Input images an edit request may carry (0: the family takes none)."""
    output_size_follows_input: bool = False
    """The pipeline picks its output size from the input image (Qwen-Image-Layered), whatever `size` asks."""
    supports_batching: bool = True
    """Text-conditioned requests with equal signatures may merge into one pipeline call."""
    supports_continuous: bool = False
    """`--batching-mode continuous` may step this family's requests in a shared denoise group
    (`pipelines/step_batch.py`): its native denoiser takes a per-row timestep, its scheduler state is per request
    and its per-batch extras depend only on the continuous group key. False (and the diffusers backend): its
    requests run as request-level batches under `continuous`."""
    continuous_key_fields: tuple[str, ...] = ()
    """`SamplingParams` fields that must also be equal within one continuous group, beyond the shared group key
    (engine/step_scheduler.py rule 2): what this family's per-step extras depend on besides the latent shape and
    guidance (LTX-2: `fps`, which sets the audio length, and `generate_audio`, whether audio tokens exist)."""
    packs_mixed_sizes: bool = False
    """The native denoiser runs rows of different sizes (and text lengths) in ONE call, padded and masked per row
    (`pipelines/packing.py`) with per-row positions, attention kept to each row's own tokens: the schedulers then
    leave the size out of the batch signature and the continuous group key (engine/scheduler.py rule 3,
    engine/step_scheduler.py rule 2) and fill batches by `--batching-max-tokens`. False (and the diffusers backend):
    a batch holds one size."""
    strength_per_row: bool = False
    """Edits of different `strength` share one call: every edit start goes through `pipelines/inpaint.py`'s
    `batch_schedule` / `first_timestep` and the recipe's `row_starts`, so `strength` leaves the batch signature
    (engine/scheduler.py rule 3). False (and the diffusers backend, and the continuous group key): one strength
    per batch."""
    cfg_batched: bool = False
    """CFG runs as ONE doubled transformer batch to match diffusers exactly, so CFG parallel (one branch per
    rank) cannot reproduce it: `plan` and start-up refuse `--enable-cfg-parallel`, and the recipe runs the
    doubled batch (`RecipePipeline.batched_cfg`)."""
    guidance: GuidanceRule = GuidanceRule()
    """Its classifier-free guidance: the scale's request field and when the negative branch runs (the recipe's
    `uses_cfg` / `cfg_scale`)."""
    run_apart_by: tuple[str, ...] = ()
    """Request fields whose different values cannot share a denoiser call but may share a batch: the recipe runs
    once per value (`pipelines/split_runs.py`; LTX-2's `fps` sets a row's audio length and video positions)."""
    peer_fields: frozenset[str] = frozenset()
    """Peer request fields (`sampling.PEER_FIELDS`) every checkpoint of the family gives meaning to, beyond what
    the checkpoint adds (`flow_shift` with a shifting scheduler, `control_image` with ControlNets loaded)."""
    text_encoder_keys: tuple[str, ...] = ()
    """model_index.json keys of the text encoders the native adapter runs, in encode order (an optional one the
    checkpoint leaves out, such as SD3's T5, is dropped by `describe_checkpoint`)."""
    required_components: tuple[str, ...] = ()
    """model_index.json keys the native adapter cannot run without: `family_spec.checkpoint.required_components`
    takes them from the loaded components for the adapter's constructor, and refuses a checkpoint that lacks one."""
    tiny_builds: dict[str, str] = field(default_factory=dict)
    """`make-tiny --family` name -> "module:function" that writes a tiny checkpoint of this family."""
    lora_loader: str | None = None
    """The diffusers pipeline class whose `*LoraLoaderMixin.lora_state_dict` reads (and converts) this family's
    LoRA files for per-request adapters (`lora/files.py`); None: the native backend serves no adapters for it."""
    controlnet_classes: tuple[str, ...] = ()
    """diffusers ControlNet model classes (a ControlNet folder's config.json `_class_name`) this family's native
    adapter runs beside its DiT (`--controlnet`, `models/controlnets.py`); empty: it takes none."""
    base_family: str | None = None
    """The family whose plan defaults a variant shares (e.g. `qwen_image` for `qwen_image_edit`)."""
    produces_audio: bool = False
    """A joint audio-video family (LTX-2): its videos carry a sound track (`RequestOutput.audios`), a request's
    `generate_audio` turns it off; other families refuse `generate_audio` naming the field."""
    quant_keep: tuple[str, ...] = ()
    """Module-name globs of the DiT that `--quantization` never quantizes (what the family's diffusers code or
    reference keeps in high precision: embedders, timestep / modulation / adaLN projections, norms, the final
    projection); `--quantization-ignored-layers` adds to it (`config/quantization.py`)."""
    text_encoders: tuple[TextEncoderFacts, ...] = ()
    """The text encoders a prompt goes through, with their token limits (prompt truncation warnings and the
    `usage` text tokens, which count the last one listed: the long-context T5 of FLUX.1 and SD3). Empty: no
    warnings; usage counts the pipeline's longest-context tokenizer."""
    request_check: Callable[..., None] | None = None
    """The family's own request checks beyond the common ones (`family_spec.request_rules.FamilyCheck`: params, the
    checkpoint's `RequestRules`, a prompt counter), a pure function run by `request_rules.validate_request` in whichever
    process builds the request; None: the common checks only."""

    @property
    def has_native(self) -> bool:
        return self.native_adapter is not None

    @property
    def inpaints(self) -> bool:
        """Edits take a `mask` (inpainting): the native adapter repaints the masked region as the family's diffusers
        inpaint pipeline does."""
        return "inpaint" in self.tasks and self.has_native
