"""Run any diffusers pipeline unmodified, so every diffusers-format checkpoint has a serving path.

A batch becomes one call with a prompt list (one entry per output row) and one generator per row,
seeded as the native pipelines seed them (row j of a request: `seed + j`), so a request's outputs do
not depend on what it was merged with. Keyword arguments are passed only when the pipeline's
`__call__` accepts them; progress and cancellation go through `callback_on_step_end`.

Video pipelines (those whose `__call__` takes `num_frames`, e.g. Wan2.1) return one list of PIL
frames per output row. Their frame count must fit the VAE's temporal compression (4k+1 for Wan),
checked up front so a bad count is a 400 naming `num_frames` rather than a silent rounding inside
diffusers.

Layer-decomposition pipelines (those whose `__call__` takes `layers`, i.e. Qwen-Image-Layered) take one
input image (as RGBA) and return several layers of it: a request's `n` is the number of layers, the call
runs with `layers=n` and one generator (seed), and the response's n images are the layers in the
pipeline's order. Their output size follows the input image (the pipeline's own 640-px-area rule), not
the request's `size`.

GLM-Image (a pipeline with an autoregressive `generate_prior_tokens` stage) runs that stage once for a
merged batch (one prompt per request, each request's rows drawn from its own seed, see
`pipelines/glm_image_ar.py`), then the DiT and VAE per request with those prior tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from diffuserve.errors import CheckpointError, ConfigError, RequestCancelledError
from diffuserve.family_spec.base import SamplingDefaults
from diffuserve.family_spec.checkpoint import describe_checkpoint
from diffuserve.pipelines import recipe
from diffuserve.pipelines.backend_outputs import to_pil, video_outputs
from diffuserve.pipelines.base import (
    BatchResult,
    Pipeline,
    PreviewCallback,
    RequestOutput,
    StepCallback,
    StopCheck,
    component_configs,
    declared_sequence_length,
)

logger = logging.getLogger(__name__)

LAYERED_RESOLUTIONS = (640, 1024)
"""Qwen-Image-Layered's resolution buckets (the `resolution` its `__call__` takes; vLLM-Omni's field)."""
_SPATIAL_FACTORS = ("vae_scale_factor", "vae_scale_factor_spatial", "vae_spatial_compression_ratio")
"""Pipeline attributes that hold the VAE's spatial factor (LTX/LTX-2 use the `*_compression_ratio` names)."""


def _vae_factor(pipe: Any, names: tuple[str, ...], fallback: int) -> int:
    """The first of the pipeline attributes `names` that is set (a VAE compression factor), else `fallback`."""
    for name in names:
        value = getattr(pipe, name, None)
        if value:
            return int(value)
    return fallback


class DiffusersBackendPipeline(Pipeline):
    """Wraps a loaded `diffusers.DiffusionPipeline`; batches by prompt lists."""

    supports_batching = True
    backend = "diffusers"
    lora_names: tuple[str, ...] = ()
    """Adapters loaded with `--lora-modules` (`load_lora_adapters`); each call runs one set of them."""

    def __init__(
        self,
        pipe: Any,
        *,
        family: str = "unknown",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        suggested_defaults: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.pipe = pipe
        self.family = family
        self.device = torch.device(device)
        self.dtype = dtype
        self.components = {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
        self._call_params = set(inspect.signature(pipe.__call__).parameters)
        self._max_sequence_length = self._declared_sequence_length(pipe)
        self.output_kind = "video" if "num_frames" in self._call_params else "image"
        # The family spec's facts for this checkpoint (the same `describe_checkpoint` the plan and the native
        # adapters use): its size rule or the pipeline class's own multiple, and its positional size limit.
        self.facts = describe_checkpoint(self.spec, component_configs(pipe.components))
        self.size_multiple = max(self._size_multiple(pipe), self.facts.size_multiple or 1)
        self.max_width, self.max_height = self.facts.max_width, self.facts.max_height
        if "image" in self._call_params:
            # An edit pipeline (its __call__ takes `image`): image inputs go to it unmodified; edits run alone. A
            # family whose spec names no limit takes one image.
            self.max_image_inputs = max(1, self.spec.max_image_inputs)
        self.layered = "layers" in self._call_params
        """A layer-decomposition pipeline: one input image in, `n` layers out (see the module docstring)."""
        if self.layered:
            self.min_image_inputs = 1
            self.max_image_inputs = 1
        # False where diffusers cannot run a prompt list (unknown families batch): diffusers 0.42.1's HunyuanVideo
        # 1.5 VAE cannot decode a batch (its attention mask); the native adapter decodes row by row and merges.
        self.supports_batching = self.spec.supports_batching and (
            type(getattr(pipe, "vae", None)).__name__ != "AutoencoderKLHunyuanVideo15"
        )
        self.ar_prior = hasattr(pipe, "generate_prior_tokens") and hasattr(pipe, "vision_language_encoder")
        """GLM-Image: an AR stage writes prior tokens before the DiT (batched across requests in `run`)."""
        if self.ar_prior:
            from diffuserve.pipelines import glm_image_ar

            # The AR tokens cover 32 px each (2x2 DiT tokens): the spec's size_multiple (32) says so, and
            # `self.size_multiple` already takes it as the minimum.
            # Image-to-image (condition images through the AR model's vision tower) is not wired here.
            self.max_image_inputs = 0
            self.supports_batching = self.supports_batching and glm_image_ar.can_batch(pipe.vision_language_encoder)
        self.frame_multiple = _vae_factor(pipe, ("vae_scale_factor_temporal", "vae_temporal_compression_ratio"), 1)
        """Video: num_frames - 1 must divide by this (the VAE's temporal compression; 4 for Wan)."""
        self.defaults = self._defaults(pipe, suggested_defaults or {})

    @staticmethod
    def _size_multiple(pipe: Any) -> int:
        """The multiple the loaded pipeline itself implies (for families with no size rule in their spec)."""
        vae_factor = _vae_factor(pipe, _SPATIAL_FACTORS, 8)
        # Patchified transformers need the latent size to divide by the patch; FLUX-like pipelines
        # pack 2x2 latent patches instead, which their image processor's factor carries. Video
        # transformers give a (frames, height, width) patch: the spatial part is what counts here.
        patch = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "patch_size", 1) or 1
        if isinstance(patch, (list, tuple)):
            patch = max(int(p) for p in patch[-2:]) if patch else 1
        processor = getattr(pipe, "image_processor", None)
        processor_factor = int(getattr(getattr(processor, "config", None), "vae_scale_factor", 0) or 0)
        return max(vae_factor * int(patch if isinstance(patch, int) else 1), processor_factor, 1)

    def _defaults(self, pipe: Any, suggested: dict[str, Any]) -> SamplingDefaults:
        # The checkpoint's suggestions first, then the pipeline's own defaults: its __call__ keyword
        # defaults (Wan: 832x480, 81 frames) and, for image pipelines, its default sample size.
        params = inspect.signature(pipe.__call__).parameters
        vae_factor = _vae_factor(pipe, _SPATIAL_FACTORS, 8)
        size = getattr(pipe, "default_sample_size", None)
        size = int(size * vae_factor) if isinstance(size, int) else 1024

        def default(name: str, fallback: Any) -> Any:
            if name in suggested:
                return suggested[name]
            value = params[name].default if name in params else inspect.Parameter.empty
            return fallback if value is inspect.Parameter.empty or value is None else value

        def snap(value: int) -> int:
            return max(self.size_multiple, int(value) // self.size_multiple * self.size_multiple)

        # True CFG's defaults are the family's (Qwen-Image: 4 with a " " negative prompt), as on the native path,
        # so a request leaving them unset runs the same call on both backends.
        family = self.spec.defaults
        return SamplingDefaults(
            true_cfg_scale=family.true_cfg_scale if "true_cfg_scale" in params else 1.0,
            negative_prompt=family.negative_prompt if "negative_prompt" in params else None,
            width=snap(default("width", size)),
            height=snap(default("height", size)),
            num_inference_steps=int(default("num_inference_steps", 28)),
            guidance_scale=float(default("guidance_scale", 3.5)),
            num_frames=int(default("num_frames", 1)) if self.output_kind == "video" else 1,
            fps=int(suggested.get("fps") or default("frame_rate", SamplingDefaults.fps)),  # LTX-2: frame_rate=24
        )

    @classmethod
    def from_pretrained(
        cls,
        model_path: Path,
        *,
        family: str = "unknown",
        device: torch.device,
        dtype: torch.dtype,
        to_device: bool = True,
        suggested_defaults: dict[str, Any] | None = None,
        quantization: Any = None,
        components: dict[str, Any] | None = None,
    ) -> DiffusersBackendPipeline:
        """Load with `DiffusionPipeline.from_pretrained(..., local_files_only=True)`; `to_device=False` leaves
        the weights on the host for the residency manager to place. `suggested_defaults`: the checkpoint's own
        (the loader reads them from model_index.json). `quantization` (component -> (method, never-quantize globs))
        becomes diffusers' `PipelineQuantizationConfig` (quant/diffusers_config.py). `components`: modules loaded
        already (a `--transformer-path` transformer), passed to diffusers in place of the folder's."""
        from diffusers import DiffusionPipeline

        extra: dict[str, Any] = dict(components or {})  # diffusers takes loaded modules by component name
        if quantization:
            from diffuserve.quant.diffusers_config import pipeline_quantization_config

            extra["quantization_config"] = pipeline_quantization_config(model_path, quantization, family, device)
            logger.info("quantization (diffusers backend, torchao): %s", dict(quantization))
        try:
            pipe = DiffusionPipeline.from_pretrained(model_path, local_files_only=True, dtype=dtype, **extra)
        except Exception as exc:  # noqa: BLE001 - every library error becomes one clear start-up error
            raise CheckpointError(
                f"checkpoint {model_path}: diffusers could not load it ({type(exc).__name__}: {exc})."
            ) from exc
        if to_device:
            pipe.to(device)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        return cls(pipe, family=family, device=device, dtype=dtype, suggested_defaults=suggested_defaults)

    def _declared_sequence_length(self, pipe: Any) -> int | None:
        """The call's `max_sequence_length` default, capped by the T5 tokenizer's (else the only tokenizer's)
        declared length (the native FLUX pipeline's rule, so both run a checkpoint with the text length it declares);
        None when the pipeline takes no such argument or has no T5 tokenizer."""
        parameter = inspect.signature(pipe.__call__).parameters.get("max_sequence_length")
        if parameter is None or not isinstance(parameter.default, int):
            return None
        for name in ("tokenizer_3", "tokenizer_2", "tokenizer"):
            tokenizer = getattr(pipe, name, None)
            if tokenizer is not None and type(tokenizer).__name__.startswith("T5"):
                return declared_sequence_length(tokenizer, parameter.default)
        # Single-tokenizer pipelines (FLUX.2, Klein): that tokenizer's declaration, as their native adapters do
        # (a processor, such as FLUX.2-dev's PixtralProcessor, holds the tokenizer that declares it).
        tokenizer = getattr(pipe, "tokenizer", None)
        if tokenizer is not None and getattr(pipe, "tokenizer_2", None) is None:
            return declared_sequence_length(getattr(tokenizer, "tokenizer", tokenizer), parameter.default)
        return None

    @contextlib.contextmanager
    def _request_settings(self, head: Any) -> Iterator[None]:
        """A request's `flow_shift` and `boundary_ratio` for one call: diffusers reads them from the pipeline's
        scheduler and config, not from `__call__`, so they are swapped in for the call and restored after (the
        calls on one pipeline never overlap)."""
        scheduler, ratio = getattr(self.pipe, "scheduler", None), getattr(self.pipe.config, "boundary_ratio", None)
        if head.flow_shift is not None:
            self.pipe.scheduler = recipe.scheduler_template(scheduler, head.flow_shift)
        if head.boundary_ratio is not None:
            self.pipe.register_to_config(boundary_ratio=head.boundary_ratio)
        try:
            yield
        finally:
            if head.flow_shift is not None:
                self.pipe.scheduler = scheduler
            if head.boundary_ratio is not None:
                self.pipe.register_to_config(boundary_ratio=ratio)

    @contextlib.contextmanager
    def _all_components_in_use(self) -> Iterator[None]:
        """Residency for an unmodified pipeline: it calls its modules itself, so no stage boundary can
        be scoped; every component is `use`d for the whole call (offloaded ones come on for the call
        and go off after it, layer-wise ones stream their layers during it)."""
        with contextlib.ExitStack() as stack:
            for name in self.components:
                stack.enter_context(self.residency.use(name))
            yield

    def _kwargs(self, batch: list[Any]) -> dict[str, Any]:
        head = batch[0]
        prompts = [p.prompt for p in batch for _ in range(p.n)]
        wanted: dict[str, Any] = {
            "prompt": prompts,
            "num_inference_steps": head.num_inference_steps,
            "guidance_scale": head.guidance_scale,
            "height": head.height,
            "width": head.width,
            "generator": recipe.row_generators(batch),
        }
        # Negative prompts go in whenever a row has one: pipelines with classic CFG (SD3, Wan) use
        # them under guidance_scale, FLUX only under true_cfg_scale > 1 (part of the signature).
        if any(p.negative_prompt for p in batch):
            wanted["negative_prompt"] = [p.negative_prompt or "" for p in batch for _ in range(p.n)]
        wanted["true_cfg_scale"] = head.true_cfg_scale
        if self.output_kind == "video":
            # LTX-2 conditions its positions on the playback rate and makes num_frames / frame_rate seconds of sound:
            # the request's fps (run calls group rows by it, `_call_key`).
            wanted.update(num_frames=head.num_frames, frame_rate=float(head.fps))
        if head.guidance_scale_2 is not None:
            wanted["guidance_scale_2"] = head.guidance_scale_2
        if head.image_inputs:
            # Edits run alone (never merged): one prompt, its n outputs as num_images_per_prompt.
            images = [Image.open(io.BytesIO(data)).convert("RGB") for data in head.image_inputs]
            wanted.update(
                prompt=head.prompt,
                image=images[0] if len(images) == 1 else images,
                num_images_per_prompt=head.n,
                strength=head.strength,
            )
            if "negative_prompt" in wanted:
                wanted["negative_prompt"] = head.negative_prompt or ""
        if self.layered:
            # One decomposition per request: n layers of its single image, from the request's own seed.
            wanted.update(
                prompt=head.prompt,
                layers=head.n,
                num_images_per_prompt=1,
                image=Image.open(io.BytesIO(head.image_inputs[0])).convert("RGBA"),
                generator=recipe.row_generators(batch)[:1],
            )
            if head.resolution is not None:
                wanted["resolution"] = head.resolution
        if "max_sequence_length" in self._call_params and self._max_sequence_length is not None:
            wanted["max_sequence_length"] = self._max_sequence_length
        if "output_type" in self._call_params:
            wanted["output_type"] = "pil" if self.output_kind == "image" else "np"
        return {k: v for k, v in wanted.items() if k in self._call_params}

    def request_facts(self) -> dict[str, Any]:
        """The layered pipelines' resolution buckets (`family_spec.request_rules.diffusers_checks`)."""
        return {"resolutions": LAYERED_RESOLUTIONS}

    def request_fields(self) -> frozenset[str]:
        """Peer fields the wrapped pipeline honours: true_cfg_scale where its `__call__` takes it; flow_shift where
        its scheduler has a shift; guidance_scale_2 and boundary_ratio on a two-expert checkpoint; a layered
        pipeline's `layers` (= n) and `resolution` bucket."""
        fields = {name for name in ("true_cfg_scale",) if name in self._call_params}
        scheduler = getattr(self.pipe, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "config") and recipe.has_flow_shift(scheduler):
            fields.add("flow_shift")
        if "guidance_scale_2" in self._call_params and getattr(self.pipe.config, "boundary_ratio", None) is not None:
            fields.update({"guidance_scale_2", "boundary_ratio"})
        if self.layered:
            fields.update({"layers", *(("resolution",) if "resolution" in self._call_params else ())})
        return frozenset(fields)

    def load_lora_adapters(self, adapters: dict[str, str]) -> None:
        """`--lora-modules` on this backend: each adapter goes through the pipeline's own `load_lora_weights`
        (`transformer_2:PATH` with `load_into_transformer_2=True`), and each call sets its batch's one adapter
        set with `set_adapters` (`run`). Refused, naming the family, when its pipeline has no LoRA loader."""
        from diffuserve.lora.files import split_target

        if not hasattr(self.pipe, "load_lora_weights"):
            raise ConfigError(
                f"--lora-modules: the {self.family} family's diffusers pipeline ({type(self.pipe).__name__}) has no "
                "LoRA loader (load_lora_weights), so it serves no adapters; drop --lora-modules."
            )
        denoisers = tuple(k for k in ("transformer", "transformer_2", "unet") if getattr(self.pipe, k, None))
        for name, spec in adapters.items():
            denoiser, path = split_target(spec, denoisers or ("transformer",))
            source = Path(path)
            kwargs: dict[str, Any] = {"weight_name": source.name} if source.is_file() else {}
            if denoiser == "transformer_2":
                kwargs["load_into_transformer_2"] = True
            try:
                self.pipe.load_lora_weights(
                    str(source.parent if source.is_file() else source), adapter_name=name, **kwargs
                )
            except Exception as exc:  # noqa: BLE001 - every library error becomes one clear start-up error
                raise ConfigError(
                    f"--lora-modules {name}={spec}: diffusers could not load it into {type(self.pipe).__name__} "
                    f"({type(exc).__name__}: {exc})."
                ) from exc
        self.pipe.disable_lora()
        self.lora_names = tuple(adapters)

    def _use_adapters(self, lora: tuple[tuple[str, float], ...]) -> None:
        """One adapter set for the next call: diffusers' `set_adapters(names, adapter_weights=scales)`, or none."""
        if not lora:
            self.pipe.disable_lora()
            return
        unknown = [name for name, _ in lora if name not in self.lora_names]
        if unknown:
            raise ValueError(f"lora: {unknown[0]!r} is asked for but is not loaded (loaded: {list(self.lora_names)})")
        self.pipe.enable_lora()
        self.pipe.set_adapters([name for name, _ in lora], adapter_weights=[scale for _, scale in lora])

    def run(
        self,
        batch: list[Any],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> BatchResult:
        """One diffusers call per adapter set (and, for a pipeline that takes `frame_rate`, per fps): requests of a
        batch with different adapters or rates (merged by the scheduler, which treats `lora` and `fps` as per-row
        fields) run as consecutive calls, one set each, in order."""
        recipe.check_batch(batch)
        named = next((p.lora for p in batch if p.lora), None)
        if named and not self.lora_names:
            raise ValueError(f"lora: {named[0][0]!r} is asked for but this pipeline has no adapters loaded")
        sets: dict[tuple[Any, ...], list[int]] = {}
        for index, params in enumerate(batch):
            sets.setdefault(self._call_key(params), []).append(index)
        outputs: list[Any] = [None] * len(batch)
        seconds: dict[str, float] = {}
        for (lora, _), indices in sets.items():
            if self.lora_names:
                self._use_adapters(lora)
            part = self._run_call([batch[i] for i in indices], on_step, should_stop)
            for i, output in zip(indices, part.outputs, strict=True):
                outputs[i] = output
            for stage, value in part.stage_seconds.items():
                seconds[stage] = seconds.get(stage, 0.0) + value
        return BatchResult(outputs=outputs, stage_seconds=seconds)

    def _call_key(self, params: Any) -> tuple[Any, ...]:
        """What one diffusers call needs its rows to share beyond the signature: the adapter set, and the fps where
        the call takes it as `frame_rate` (LTX-2)."""
        return (tuple(params.lora), params.fps if "frame_rate" in self._call_params else None)

    def _run_call(self, batch: list[Any], on_step: StepCallback | None, should_stop: StopCheck | None) -> BatchResult:
        """One diffusers call for `batch` (one adapter set)."""
        kwargs = self._kwargs(batch)
        num_steps = batch[0].num_inference_steps
        cancelled: list[int] = []

        def callback(pipe: Any, i: int, t: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            if on_step is not None:
                on_step(i, num_steps)
            if should_stop is not None and i + 1 < num_steps and should_stop():
                cancelled.append(i)
                # Raising here leaves the diffusers loop at once (its `interrupt` flag would still
                # decode the partial latents).
                raise RequestCancelledError(f"cancelled after denoising step {i + 1}/{num_steps}")
            return {}

        if "callback_on_step_end" in self._call_params:
            kwargs["callback_on_step_end"] = callback
        if should_stop is not None and should_stop():
            raise RequestCancelledError("cancelled before denoising step 1")
        start = time.perf_counter()
        if self.ar_prior:
            return self._run_ar_prior(batch, callback if "callback_on_step_end" in self._call_params else None, start)
        with torch.inference_mode(), self._all_components_in_use(), self._request_settings(batch[0]):
            result = self.pipe(**kwargs)
        elapsed = time.perf_counter() - start
        if self.output_kind == "video":
            outputs = video_outputs(self.pipe, result, batch, self.produces_audio)
        else:
            items = getattr(result, "images", None)
            items = result[0] if items is None else items
            # A layered pipeline returns one list of layers per call (one request): those are its n images.
            images = [to_pil(im) for im in (items[0] if self.layered else items)]
            outputs = [RequestOutput(images=rows) for rows in recipe.rows_per_request(images, batch)]
        return BatchResult(outputs=outputs, stage_seconds={"total": elapsed})

    def _run_ar_prior(self, batch: list[Any], callback: Any, start: float) -> BatchResult:
        """GLM-Image: one batched AR call (a prompt per request, drawn from the request's seed), then the DiT
        and VAE per request with its prior tokens, n rows each (the pipeline repeats a prompt's prior tokens
        over its `num_images_per_prompt` rows, as in its own call)."""
        from diffuserve.pipelines import glm_image_ar

        head = batch[0]
        outputs = []
        with torch.inference_mode(), self._all_components_in_use(), self._request_settings(head):
            prior = glm_image_ar.prior_tokens(
                self.pipe,
                [p.prompt for p in batch],
                [recipe.row_seeds(p)[0] for p in batch],
                height=head.height,
                width=head.width,
                device=self.device,
            )
            ar_done = time.perf_counter()
            for i, params in enumerate(batch):
                kwargs = self._kwargs([params])
                kwargs.update(prompt=params.prompt, num_images_per_prompt=params.n, prior_token_ids=prior[i : i + 1])
                if callback is not None:
                    kwargs["callback_on_step_end"] = callback
                images = self.pipe(**kwargs).images
                outputs.append(RequestOutput(images=[to_pil(im) for im in images]))
        end = time.perf_counter()
        return BatchResult(
            outputs=outputs, stage_seconds={"ar": ar_done - start, "dit_vae": end - ar_done, "total": end - start}
        )
