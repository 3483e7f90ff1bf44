"""Native SANA (600M / 1600M / 1.5): diffusers' model classes and scheduler on the shared recipe.

The family parts follow `diffusers.SanaPipeline` with its default arguments, so the same request and the
same call give the same image:
- texts are lower-cased and stripped (`clean_caption=False`); a prompt gets the pipeline's default complex
  human instruction in front, is padded to `len(instruction tokens) + 298` and encoded by Gemma2, and then
  only the first token and the last 299 positions are kept (300 tokens, as diffusers selects); a negative
  prompt (default "") is encoded without the instruction, padded to 300. Both come with their attention
  masks, and the transformer's cross-attention ignores the padding;
- CFG runs when `guidance_scale > 1`, classic `uncond + g * (cond - uncond)`, in one doubled transformer call
  as diffusers does; PAG is not part of SanaPipeline (SanaPAGPipeline is another class);
- resolution binning (diffusers' default `use_resolution_binning=True`): a requested size is generated at the
  closest aspect-ratio bin of the checkpoint's table (picked by the transformer's `sample_size`: 16 -> the
  512 px table, 32 -> 1024, 64 -> 2048, 128 -> 4096) and the decoded image is resized and centre-cropped back
  to the requested size, with diffusers' own helpers. A checkpoint whose `sample_size` has no table (where
  diffusers' default call raises) generates at the requested size;
- the scheduler is the checkpoint's (flow DPM-Solver++ upstream, a multistep solver: each batch gets its own
  solver history).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.image_processor import PixArtImageProcessor
from diffusers.pipelines.sana import pipeline_sana
from diffusers.pipelines.sana.pipeline_sana import SanaPipeline, retrieve_timesteps

from diffuserve.pipelines import recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs
from diffuserve.pipelines.recipe import Cond, DenoiseState
from diffuserve.pipelines.schedules import flow_schedule

logger = logging.getLogger(__name__)

MAX_SEQUENCE_LENGTH = 300
"""Text tokens the transformer sees per row: SanaPipeline's `max_sequence_length` default."""

COMPLEX_HUMAN_INSTRUCTION: list[str] = list(
    inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
)
"""The instruction SanaPipeline prepends to every prompt by default (read from diffusers, not restated)."""

ASPECT_RATIO_BINS: dict[int, dict[str, list[float]]] = {
    128: pipeline_sana.ASPECT_RATIO_4096_BIN,
    64: pipeline_sana.ASPECT_RATIO_2048_BIN,
    32: pipeline_sana.ASPECT_RATIO_1024_BIN,
    16: pipeline_sana.ASPECT_RATIO_512_BIN,
}
"""transformer `sample_size` -> the bin table SanaPipeline's resolution binning uses for it."""


class SanaAdapter(AdapterBase):
    """SANA text-to-image, the adapter of the recipe."""

    family = "sana"
    # Continuous (the spec's `supports_continuous`): each request keeps its own DPM-Solver++ history (`_schedule`
    # copies), and `step_extras` gives a mixed step the group's row count, which `predict` needs to tell the doubled
    # CFG call (the spec's `cfg_batched`) from a plain one.
    # No trimming of the padded text columns: every row is 300 tokens wide as in diffusers, whose
    # transformer output depends (~1e-6) on how many masked columns cross-attention sees.
    masked_sequences: dict[str, str] = {}

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
    ) -> None:
        super().__init__()
        self.bind_parts(
            {
                "text_encoder": text_encoder,
                "tokenizer": tokenizer,
                "transformer": transformer,
                "vae": vae,
                "scheduler": scheduler,
            },
            device=device,
            dtype=dtype,
        )
        self.vae_scale_factor = self.bind_facts(component_configs(self.components)).vae_factor
        self.image_processor = PixArtImageProcessor(vae_scale_factor=self.vae_scale_factor)
        self.aspect_ratio_bin = ASPECT_RATIO_BINS.get(int(transformer.config.sample_size))
        if self.aspect_ratio_bin is None:
            logger.warning(
                "sana: transformer sample_size=%s has no resolution-binning table; images are "
                "generated at the requested size",
                transformer.config.sample_size,
            )
        # The instruction's token count fixes where the kept 299 prompt positions start (diffusers counts it
        # with the tokenizer's special tokens, i.e. including <bos>).
        instruction = "\n".join(COMPLEX_HUMAN_INSTRUCTION)
        self._instruction = instruction
        self._prompt_length = len(tokenizer.encode(instruction)) + MAX_SEQUENCE_LENGTH - 2
        self._keep = torch.tensor([0, *range(self._prompt_length - MAX_SEQUENCE_LENGTH + 1, self._prompt_length)])
        self._schedules: dict[tuple[int, float | None], tuple[Any, torch.Tensor]] = {}

    # -- family parts ------------------------------------------------------------------------------------

    def _gemma(self, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Last hidden state + attention mask of `texts` padded to `length`, as diffusers encodes them.

        The encoder runs over the padding too: the transformer's cross-attention masks padded positions,
        but their values still move its output by ~1e-6, so they are computed exactly as diffusers does."""
        inputs = self.tokenizer(
            texts,
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(self.device)
        hidden = self.text_encoder(inputs.input_ids.to(self.device), attention_mask=mask)[0]
        return hidden.to(self.text_encoder.dtype), mask

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """`prompt_embeds`/`prompt_mask` (instruction + prompt, the kept 300 positions) for texts used as
        prompts and `negative_embeds`/`negative_mask` (plain, 300) for texts used as negative prompts.

        The recipe encodes each distinct text once for both roles, but SANA encodes the roles differently,
        so each row carries both variants (zeros where a text has no such role) and `predict` picks per half.
        """
        prompts = {p.prompt for p in batch}
        negatives = {p.negative_prompt or "" for p in batch} if self.guidance_rule.runs(batch[0]) else set()
        clean = [t.lower().strip() for t in texts]
        hidden_size = self.text_encoder.config.hidden_size
        out: Cond = {}
        for name, wanted in (("prompt", prompts), ("negative", negatives)):
            rows = [i for i, t in enumerate(texts) if t in wanted]
            embeds = torch.zeros(
                (len(texts), MAX_SEQUENCE_LENGTH, hidden_size), device=self.device, dtype=self.text_encoder.dtype
            )
            mask = torch.zeros((len(texts), MAX_SEQUENCE_LENGTH), device=self.device, dtype=torch.long)
            if rows:
                if name == "prompt":
                    full, full_mask = self._gemma([self._instruction + clean[i] for i in rows], self._prompt_length)
                    keep = self._keep.to(self.device)
                    embeds[rows], mask[rows] = full[:, keep], full_mask[:, keep]
                else:
                    embeds[rows], mask[rows] = self._gemma([clean[i] for i in rows], MAX_SEQUENCE_LENGTH)
            out[f"{name}_embeds"], out[f"{name}_mask"] = embeds, mask
        return out

    def _schedule(self, num_steps: int, flow_shift: float | None = None) -> tuple[Any, torch.Tensor]:
        """A private scheduler with its timesteps (a multistep solver: `fresh_scheduler` deep-copies its history)."""

        return flow_schedule(self._schedules, self.scheduler, retrieve_timesteps, self.device, num_steps, flow_shift)

    def generation_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the model runs at for a requested size: its aspect-ratio bin when binning."""
        if self.aspect_ratio_bin is None:
            return height, width
        return self.image_processor.classify_height_width_bin(height, width, ratios=self.aspect_ratio_bin)

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        height, width = self.generation_size(head.height, head.width)
        channels = self.transformer.config.in_channels
        shape = (channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        latents = recipe.batch_noise(batch, shape, device=self.device, dtype=torch.float32)
        scheduler, timesteps = self._schedule(head.num_inference_steps, head.flow_shift)
        extras = {"rows": latents.shape[0], "size": (head.height, head.width)}
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        # `rows` is the call's positive rows: every request's, not the first one's (else a group of two would look
        # like the doubled CFG call of one and take the negative encoding for the second request's rows).
        return {**states[0].extras, "rows": sum(s.extras["rows"] for s in states)}

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        rows = state.extras["rows"]
        if latents.shape[0] == rows:
            embeds, mask = cond["prompt_embeds"], cond["prompt_mask"]
        else:  # the doubled CFG call: positive rows first, then negative rows
            embeds = torch.cat([cond["prompt_embeds"][:rows], cond["negative_embeds"][rows:]])
            mask = torch.cat([cond["prompt_mask"][:rows], cond["negative_mask"][rows:]])
        dtype = self.transformer.dtype
        out = self.transformer(
            latents.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            encoder_attention_mask=mask,
            timestep=timestep * self.transformer.config.timestep_scale,
            return_dict=False,
        )[0].float()
        if self.transformer.config.out_channels // 2 == self.transformer.config.in_channels:
            out = out.chunk(2, dim=1)[0]  # learned sigma: keep the prediction half
        return out

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
        image = self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]
        if self.aspect_ratio_bin is not None:
            height, width = state.extras["size"]
            image = self.image_processor.resize_and_crop_tensor(image, width, height)
        return self.image_processor.postprocess(image, output_type="pil")
