"""Native FLUX.2 pipelines: FLUX.2-dev (`Flux2Pipeline`) and FLUX.2-Klein (`Flux2KleinPipeline`).

Both follow their diffusers pipeline step for step, reusing its static helpers (prompt encoding with the
hidden-state layer stack, position ids, latent (un)patchify and packing, `compute_empirical_mu`), so a request
and the diffusers call with the same values give the same image. What diffusers does, and we therefore do:

- Text: the prompt goes through the encoder's chat template (FLUX.2-dev adds its system message), padded to
  `max_sequence_length` (diffusers: 512, capped here by the tokenizer's declared length), and the hidden states
  of layers (10, 20, 30) (Mistral3) or (9, 18, 27) (Qwen3) are stacked on the channel axis: (rows, L, 3 x hidden).
  The transformer gets no attention mask: padding tokens take part in attention, so every row has L tokens and
  merged rows need no masks (prompts of any length give the same shapes).
- Positions: 4 axes (t, h, w, l). Text tokens are (0, 0, 0, i); image tokens (0, row, col, 0); the tokens of
  reference image k are (10 + 10k, row, col, 0). RoPE is computed from these ids on the fly, so there is no
  positional table and no size limit from the transformer's config.
- Guidance: FLUX.2-dev embeds `guidance_scale` (a float32 vector per row, no CFG). Klein has no guidance
  embedding; Klein-Base runs CFG (uncond text "", or the request's negative prompt) when guidance_scale > 1,
  and distilled Klein (`is_distilled` in model_index.json) never does.
- Timesteps: sigmas linspace(1, 1/steps, steps) with `mu = compute_empirical_mu(image tokens, steps)` (the
  reference-image tokens do not count); the transformer gets `t / 1000`.
- Latents: noise (rows, 4 x latent channels, h/16, w/16) drawn per row, packed to (rows, tokens, channels);
  decode unpacks, undoes the VAE's batch-norm normalisation (x * sqrt(var + eps) + mean), unpatchifies 2x2 and
  decodes; pixels are rounded as diffusers' image processor does.
- Reference images (edits): each is checked (>= 64 px a side, aspect <= 8), shrunk to 1 MP when larger, floored
  to the size multiple, centre-cropped, VAE-encoded (distribution mode, no noise), patchified, normalised and
  packed; its tokens follow the noise tokens in every transformer call and are dropped from the output.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2 import (
    Flux2Pipeline,
    compute_empirical_mu,
    format_input,
    retrieve_latents,
    retrieve_timesteps,
)
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from PIL import Image

from diffuserve.errors import CheckpointError
from diffuserve.families.flux2 import inpaint as flux2_inpaint
from diffuserve.families.flux2.ops import Flux2Packing
from diffuserve.family_spec.checkpoint import required_components
from diffuserve.pipelines import inpaint, recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.prompt_limits import TextReading
from diffuserve.pipelines.recipe import Cond, DenoiseState
from diffuserve.pipelines.schedules import flow_schedule

logger = logging.getLogger(__name__)

DEFAULT_SEQUENCE_LENGTH = 512
"""diffusers' `max_sequence_length` default for both pipelines."""
REFERENCE_MAX_AREA = 1024 * 1024
"""Reference images above this many pixels are first shrunk to it (as the diffusers pipelines do)."""
REFERENCE_MIN_SIDE = 64
"""`Flux2ImageProcessor.check_image_input` refuses reference images with a side below this ..."""
REFERENCE_MAX_ASPECT = 8
"""... or an aspect ratio above this."""
MAX_CACHED_SHAPES = 64
"""Per-shape caches (position ids, schedules) are cleared past this many entries."""


def _make_room(cache: dict) -> None:
    if len(cache) >= MAX_CACHED_SHAPES:
        cache.clear()


def _checkpoint_root(module: Any) -> Path | None:
    """The checkpoint folder `module` was loaded from (its component folder's parent), or None.

    Pipeline-level facts (Klein's `is_distilled`) live in its model_index.json, and the loader hands adapters
    only the loaded components (it applies a checkpoint's suggested defaults itself)."""
    folder = getattr(getattr(module, "config", None), "_name_or_path", None)
    return Path(folder).parent if folder else None


def _model_index(root: Path | None) -> dict[str, Any]:
    try:
        index = json.loads((root / "model_index.json").read_text()) if root else {}
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _declared_length(tokenizer: Any) -> int | None:
    # A PixtralProcessor (the real FLUX.2-dev `tokenizer`) wraps the tokenizer that declares the length.
    declared = getattr(getattr(tokenizer, "tokenizer", tokenizer), "model_max_length", None)
    return int(declared) if isinstance(declared, int) and 0 < declared < 10**9 else None


def _text_config(text_encoder: Any) -> Any:
    config = text_encoder.config
    return getattr(config, "text_config", None) or config


class Flux2Adapter(Flux2Packing, AdapterBase):
    """FLUX.2-dev: Mistral3 text encoder, embedded guidance (`guidance_scale`), no CFG; reference images."""

    family = "flux2"
    denoisers = ("transformer",)
    hidden_states_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)
    """Encoder layers whose hidden states are stacked (diffusers' `text_encoder_out_layers` default)."""

    def __init__(
        self,
        *,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        tokenizer: Any,
        scheduler: Any,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
        model_index: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length
        """Text tokens per prompt (every prompt is padded to it; the transformer attends to all of them)."""
        self.text_readings = {"tokenizer": TextReading(cap=max_sequence_length, framed_empty=self._framed_empty)}
        self.model_index = model_index or {}
        """The checkpoint's model_index.json (pipeline-level config such as Klein's `is_distilled`)."""
        self.components = {"text_encoder": text_encoder, "transformer": transformer, "vae": vae}
        # The spec's facts: 2x2-patchified latents (size multiple), no positional table (RoPE from position ids),
        # the variant's defaults (Klein-Base vs distilled Klein: `family_spec/flux2.py`).
        facts = self.bind_facts(component_configs(self.components, self.model_index))
        self.vae_scale_factor = facts.vae_factor
        self.image_processor = Flux2ImageProcessor(vae_scale_factor=self.size_multiple)
        self._latent_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._text_ids: dict[int, torch.Tensor] = {}
        self._schedules: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}

    @staticmethod
    def _framed_empty(tokenizer: Any) -> int:
        """Tokens an empty text becomes in diffusers' chat format: the system message, then the text as the user
        turn (the prompt counter's framing, `text_readings`)."""
        return len(
            tokenizer.apply_chat_template(
                format_input([""], system_message=SYSTEM_MESSAGE)[0],
                add_generation_prompt=False,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> Flux2Adapter:
        """Build from the loader's model_index.json key -> loaded object mapping."""
        parts = required_components(cls.family, components)
        text_encoder = parts["text_encoder"]
        text_config = _text_config(text_encoder)
        layers = int(getattr(text_config, "num_hidden_layers", 0))
        if max(cls.hidden_states_layers) > layers:
            raise CheckpointError(
                f"{cls.family}: the text encoder has {layers} layers but the pipeline stacks the hidden states of "
                f"layers {list(cls.hidden_states_layers)}; the text_encoder folder does not belong to this model."
            )
        # diffusers' 512 text tokens, capped by what the tokenizer declares (tiny checkpoints declare fewer) and by
        # the encoder's positions.
        length = DEFAULT_SEQUENCE_LENGTH
        for limit in (_declared_length(components["tokenizer"]), getattr(text_config, "max_position_embeddings", None)):
            if isinstance(limit, int) and limit > 0:
                length = min(length, limit)
        root = _checkpoint_root(components["transformer"])
        logger.info(
            "%s: %d text tokens per prompt, hidden-state layers %s", cls.family, length, list(cls.hidden_states_layers)
        )
        return cls(
            **parts,
            device=device,
            dtype=dtype,
            max_sequence_length=length,
            model_index=_model_index(root),
        )

    # -- defaults and validation -------------------------------------------------------------------------

    def _guidance_hint(self) -> str:
        return "FLUX.2-dev is guidance-distilled: set guidance_scale (embedded guidance) instead."

    def _negative_hint(self) -> str:
        return "FLUX.2-dev is guidance-distilled and runs no unconditional branch; drop negative_prompt."

    # -- 1. text -------------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """Chat-formatted texts through the encoder; layers 10/20/30 stacked: (texts, L, 3 x hidden)."""
        embeds = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            prompt=texts,
            dtype=self.dtype,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            system_message=SYSTEM_MESSAGE,
            hidden_states_layers=self.hidden_states_layers,
        )
        return {"prompt_embeds": embeds}

    # -- 2. latents, position ids, schedule ----------------------------------------------------------------

    def _latent_ids_for(self, tokens_h: int, tokens_w: int) -> torch.Tensor:
        key = (tokens_h, tokens_w)
        if key not in self._latent_ids:
            _make_room(self._latent_ids)
            probe = torch.empty(1, 1, tokens_h, tokens_w)
            self._latent_ids[key] = Flux2Pipeline._prepare_latent_ids(probe)[0].to(self.device)
        return self._latent_ids[key]

    def _text_ids_for(self, seq_len: int) -> torch.Tensor:
        if seq_len not in self._text_ids:
            _make_room(self._text_ids)
            self._text_ids[seq_len] = Flux2Pipeline._prepare_text_ids(torch.empty(1, seq_len, 1))[0].to(self.device)
        return self._text_ids[seq_len]

    def _schedule(
        self, num_steps: int, image_seq_len: int, flow_shift: float | None = None
    ) -> tuple[Any, torch.Tensor]:
        """A private scheduler with this shape's timesteps (the set-up is cached per shape and `flow_shift`)."""

        return flow_schedule(
            self._schedules,
            self.scheduler,
            retrieve_timesteps,
            self.device,
            num_steps,
            flow_shift,
            shape_key=(image_seq_len,),
            sigmas=lambda config: (
                None if getattr(config, "use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
            ),
            mu=lambda config: compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps),
        )

    def _reference_tokens(self, params: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's reference images as packed tokens (1, N, C) and their position ids (N, 4)."""
        latents = self._reference_latents(params.image_inputs)
        ids = Flux2Pipeline._prepare_image_ids(latents)[0].to(self.device)
        tokens = torch.cat([Flux2Pipeline._pack_latents(x)[0] for x in latents]).unsqueeze(0)
        return tokens, ids

    def _reference_latents(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Encoded reference images, each (1, 4C, h, w) at its own (floored, <= 1 MP) size."""
        latents = []
        for data in images:
            image = Image.open(io.BytesIO(data))
            image.load()
            width, height = image.size
            if width * height > REFERENCE_MAX_AREA:
                image = self.image_processor._resize_to_target_area(image, REFERENCE_MAX_AREA)
                width, height = image.size
            width = width // self.size_multiple * self.size_multiple
            height = height // self.size_multiple * self.size_multiple
            pixels = self.image_processor.preprocess(image, height=height, width=width, resize_mode="crop")
            pixels = pixels.to(self.device, self.vae.dtype)
            # Distribution mode (no sampling): the reference is the same whatever the seed.
            latent = Flux2Pipeline._patchify_latents(retrieve_latents(self.vae.encode(pixels), sample_mode="argmax"))
            mean, std = self._bn_stats(latent)
            latents.append((latent - mean) / std)
        return latents

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        """Per-row noise (row j of a request from seed + j), packed; cached ids and schedule; reference tokens.
        Masked edits (Klein's inpainting) start from their re-noised image instead (`families/flux2/inpaint.py`)."""
        if inpaint.any_mask(batch):
            return flux2_inpaint.prepare_masked(self, batch, head, positive)
        tokens_h, tokens_w = head.height // self.size_multiple, head.width // self.size_multiple
        channels = self.transformer.config.in_channels
        noise = recipe.batch_noise(
            batch, (channels, tokens_h, tokens_w), device=self.device, dtype=positive["prompt_embeds"].dtype
        )
        latents = Flux2Pipeline._pack_latents(noise)
        scheduler, timesteps = self._schedule(head.num_inference_steps, tokens_h * tokens_w, head.flow_shift)
        img_ids = self._latent_ids_for(tokens_h, tokens_w)
        reference = None
        if head.image_inputs:
            # Edits run alone (never merged), so the batch is one request and its rows share the references.
            reference, ref_ids = self._reference_tokens(head)
            img_ids = torch.cat([img_ids, ref_ids])
        extras = {
            "tokens": (tokens_h, tokens_w),
            "img_ids": img_ids,
            "txt_ids": self._text_ids_for(positive["prompt_embeds"].shape[1]),
            "guidance": self._guidance_vector(head),
            "reference": reference,
        }
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def _guidance_vector(self, head: Any) -> torch.Tensor | None:
        if not getattr(self.transformer.config, "guidance_embeds", False):
            return None
        return torch.full([1], head.guidance_scale, device=self.device, dtype=torch.float32)

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent batch-norm mean and std (sqrt(var + eps)), shaped and typed to broadcast on `like`."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    # -- 3. one transformer call ------------------------------------------------------------------------------

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        if "packed" in state.extras:
            return self.predict_packed(latents, timestep, cond, state)
        extras = state.extras
        reference = extras["reference"]
        if reference is not None:
            # After the generated image's tokens: one copy per row, or per-row references (masked edits) repeated
            # for the branches of a doubled CFG batch.
            if reference.shape[0] == 1:
                reference = reference.expand(latents.shape[0], -1, -1)
            elif reference.shape[0] != latents.shape[0]:
                reference = reference.repeat(latents.shape[0] // reference.shape[0], 1, 1)
            latents_in = torch.cat([latents, reference], dim=1)
        else:
            latents_in = latents
        guidance = extras["guidance"]
        out = self.transformer(
            hidden_states=latents_in.to(self.transformer.dtype),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None if guidance is None else guidance.expand(latents.shape[0]),
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=extras["txt_ids"],
            img_ids=extras["img_ids"],
            return_dict=False,
        )[0]
        # The reference tokens' outputs are dropped: only the generated image's tokens are denoised.
        return out[:, : latents.shape[1]]

    # -- 4. decode ------------------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """Unpack tokens to the (rows, C, h, w) grid, undo the batch-norm normalisation, unpatchify, decode."""
        tokens_h, tokens_w = state.extras["tokens"]
        # The ids are a full row-major grid, so diffusers' scatter by ids is exactly this reshape.
        grid = latents.transpose(1, 2).reshape(latents.shape[0], latents.shape[2], tokens_h, tokens_w)
        mean, std = self._bn_stats(grid)
        grid = Flux2Pipeline._unpatchify_latents(grid * std + mean)
        image = self.vae.decode(grid.to(self.vae.dtype), return_dict=False)[0]
        return inpaint.apply_overlays(recipe.to_pil_images(image), state, self.image_processor)


class Flux2KleinAdapter(Flux2Adapter):
    """FLUX.2-Klein (4B/9B distilled, and Klein-Base): Qwen3 encoder, no guidance embedding; Klein-Base runs
    CFG at `guidance_scale` > 1 (uncond text "" or the negative prompt), distilled Klein never does."""

    family = "flux2_klein"
    hidden_states_layers: ClassVar[tuple[int, ...]] = (9, 18, 27)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._empty_embeds: torch.Tensor | None = None
        """The encoding of "" (the unconditional text), computed on first use."""
        # A step-distilled checkpoint runs no negative branch, whatever the guidance scale (`flux2/spec.check_flux2`).
        self.family_facts = {"is_distilled": self.is_distilled}
        if self.is_distilled:
            self.guidance_rule = dataclasses.replace(self.guidance_rule, runs_when="never")

    @staticmethod
    def _framed_empty(tokenizer: Any) -> int:
        """Tokens an empty text becomes in diffusers' Qwen3 chat template: one user turn, thinking off."""
        chat = [{"role": "user", "content": ""}]
        return len(
            tokenizer(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
            ).input_ids
        )

    @property
    def is_distilled(self) -> bool:
        """model_index.json `is_distilled` (step-distilled Klein 4B/9B: guidance is ignored)."""
        return bool(self.model_index.get("is_distilled", False))

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        # Masked edits put the kept region back after every step (a no-op for other batches).
        return inpaint.blended_step(noise_pred, timestep, latents, state)

    def _guidance_hint(self) -> str:
        return "FLUX.2-Klein's classifier-free guidance scale is guidance_scale."

    def _negative_hint(self) -> str:
        if self.is_distilled:
            return "this FLUX.2-Klein checkpoint is step-distilled and runs no unconditional branch."
        return "the unconditional branch runs only with guidance_scale > 1."

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """Qwen3 chat-formatted texts; layers 9/18/27 stacked: (texts, L, 3 x hidden).

        The unconditional text "" of Klein-Base's CFG is encoded once, alone (as diffusers encodes it, in its own
        call), and reused: every CFG batch would otherwise encode it again."""
        rest = [t for t in texts if t != ""]
        encoded = dict(zip(rest, self._qwen3_embeds(rest), strict=True)) if rest else {}
        if "" in texts:
            if self._empty_embeds is None:
                self._empty_embeds = self._qwen3_embeds([""])
            encoded[""] = self._empty_embeds[0]
        return {"prompt_embeds": torch.stack([encoded[t] for t in texts])}

    def _qwen3_embeds(self, texts: list[str]) -> torch.Tensor:
        return Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            prompt=texts,
            dtype=self.dtype,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            hidden_states_layers=self.hidden_states_layers,
        )
