"""Native Stable Diffusion 3 / 3.5: diffusers' model classes and scheduler on the shared recipe.

What `diffusers.StableDiffusion3Pipeline.__call__` does, and so what this adapter does:
1. Text: two CLIP encoders with projection give their penultimate hidden states (77 tokens each,
   concatenated along features) and their pooled projections (concatenated: `pooled_projections`);
   T5 gives `max_sequence_length` padded tokens. The CLIP features are zero-padded to T5's width and
   the two sequences concatenated along tokens (zeros in T5's place for a checkpoint saved without
   it). Every text pads to fixed lengths, so merged rows need no attention mask.
2. Guidance: classic CFG whenever `guidance_scale > 1`, against the negative prompt "" when none is
   given, as one doubled transformer batch per step; combined as diffusers does. Skip-layer guidance
   (off in diffusers by default) is not offered.
3. Timesteps: the checkpoint's flow-matching scheduler, `set_timesteps(steps)` with its static shift
   (and `mu` from the image token count when its config enables dynamic shifting).
4. Latents: N(0, 1) noise (rows, C, H/8, W/8), one generator per row; decode divides by the VAE's
   `scaling_factor`, adds its `shift_factor`, and rounds pixels as diffusers' image processor does.

Sizes: multiples of VAE factor x patch size (16), at most `pos_embed_max_size` patches per side (the
transformer crops its positional table and cannot run beyond it: a 192-patch table gives 192 x 2 x 8 = 3072 px).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from diffuserve.families.sd3 import controlnet as sd3_controlnet
from diffuserve.family_spec.checkpoint import required_components
from diffuserve.pipelines import inpaint, packing, recipe
from diffuserve.pipelines.adapter import AdapterBase
from diffuserve.pipelines.base import component_configs, declared_sequence_length
from diffuserve.pipelines.controlnet import EXTRAS_KEY, merge_rows
from diffuserve.pipelines.recipe import Cond, DenoiseState

logger = logging.getLogger(__name__)

DIFFUSERS_MAX_SEQUENCE_LENGTH = 256
"""`StableDiffusion3Pipeline.__call__`'s default T5 length (capped by what tokenizer_3 declares)."""

# The pieces `encode_text` returns; `_join` assembles them into the transformer's two inputs.
_CLIP_KEYS = {"text_encoder": ("clip_1", "pooled_1"), "text_encoder_2": ("clip_2", "pooled_2")}


class SD3Adapter(AdapterBase):
    """SD3 / SD3.5 text-to-image, the adapter of the recipe."""

    family = "sd3"
    supports_controlnet = True
    """`--controlnet` SD3ControlNetModel rows run natively (`families/sd3/controlnet.py`)."""

    def __init__(self, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.transformer = components["transformer"]
        self.vae = components["vae"]
        self.clip = {"text_encoder": components["text_encoder"], "text_encoder_2": components["text_encoder_2"]}
        self.clip_tokenizers = {"text_encoder": components["tokenizer"], "text_encoder_2": components["tokenizer_2"]}
        self.t5 = components.get("text_encoder_3")
        self.t5_tokenizer = components.get("tokenizer_3")
        if (self.t5 is None) != (self.t5_tokenizer is None):
            from diffuserve.errors import CheckpointError

            raise CheckpointError(
                "an SD3 checkpoint has text_encoder_3 and tokenizer_3 both or neither; "
                "model_index.json names only one of them."
            )
        # The spec's facts for these configs: a checkpoint saved without T5 (a memory saving diffusers supports)
        # encodes with the two CLIPs only, its T5 tokens zeros as diffusers does; size rule, limit and defaults.
        facts = self.bind_facts(component_configs(components))
        self.scheduler = components["scheduler"]
        self.device = torch.device(device)
        self.dtype = dtype
        self.components = {key: components[key] for key in (*self.text_encoders, "transformer", "vae")}
        self.max_sequence_length = (
            DIFFUSERS_MAX_SEQUENCE_LENGTH
            if self.t5_tokenizer is None
            else declared_sequence_length(self.t5_tokenizer, DIFFUSERS_MAX_SEQUENCE_LENGTH)
        )
        """T5 tokens per text: diffusers' 256, capped by what tokenizer_3 declares."""
        self.clip_length = int(getattr(components["tokenizer"], "model_max_length", 77) or 77)
        # The model_index tokenizers under their keys, where the prompt counter looks them up (`tokenizer_part`).
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = (
            components["tokenizer"],
            components["tokenizer_2"],
            self.t5_tokenizer,
        )
        self.vae_scale_factor = facts.vae_factor
        channels = self.vae.config.latent_channels
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor, vae_latent_channels=channels)
        self.mask_processor = inpaint.mask_processor(self.vae_scale_factor, channels)
        self.patch_size = int(self.transformer.config.patch_size)
        self._schedulers: dict[tuple[int, int, float | None], tuple[Any, torch.Tensor]] = {}
        self._empty: dict[str, Cond] = {}
        """Text encoder key -> its encoding of "" (see `_encode_empty`)."""

    @classmethod
    def from_components(
        cls, components: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype
    ) -> SD3Adapter:
        """Build from the loader's model_index.json key -> loaded object mapping."""
        required_components(cls.family, components)  # T5 (`text_encoder_3`, `tokenizer_3`) may be left out
        return cls(components, device=device, dtype=dtype)

    # -- guidance: diffusers' rule ---------------------------------------------------------------------

    # -- 1. encode --------------------------------------------------------------------------------------

    def encode_text(self, key: str, texts: list[str], batch: Sequence[Any]) -> Cond:
        """CLIP: penultimate hidden states and pooled projection; T5: its padded hidden states."""
        # The batch's prompts and its other texts (negative prompts) go through the encoder in two
        # calls, as diffusers encodes them: the pooled projection's matmul rounds differently for one row
        # and for several, so a joint call would move a singleton off diffusers' image by a pixel level.
        prompts = {p.prompt for p in batch}
        groups = [[t for t in texts if t in prompts], [t for t in texts if t not in prompts]]
        parts = [
            self._encode_empty(key) if group == [""] else self._encode_group(key, group) for group in groups if group
        ]
        out = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
        order = [t for group in groups for t in group]
        if order != texts:
            index = torch.tensor([order.index(t) for t in texts], device=next(iter(out.values())).device)
            out = {name: value.index_select(0, index) for name, value in out.items()}
        return out

    def _encode_empty(self, key: str) -> Cond:
        """The encoding of "" (the unconditional text of every CFG request without a negative prompt), made
        once: the same tensors a fresh one-row call gives, without running the encoder per request."""
        if key not in self._empty:
            self._empty[key] = self._encode_group(key, [""])
        return self._empty[key]

    def _encode_group(self, key: str, texts: list[str]) -> Cond:
        if key == "text_encoder_3":
            ids = self.t5_tokenizer(
                texts,
                padding="max_length",
                max_length=self.max_sequence_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).input_ids
            return {"t5": self.t5(ids.to(self.device))[0].to(self.t5.dtype)}
        ids = self.clip_tokenizers[key](
            texts, padding="max_length", max_length=self.clip_length, truncation=True, return_tensors="pt"
        ).input_ids
        out = self.clip[key](ids.to(self.device), output_hidden_states=True)
        hidden, pooled = _CLIP_KEYS[key]
        # The penultimate layer (diffusers' clip_skip=None), in the first encoder's dtype as upstream.
        return {hidden: out.hidden_states[-2].to(self.clip["text_encoder"].dtype), pooled: out[0]}

    def _join(self, cond: Cond) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder_hidden_states, pooled_projections) from the encoders' pieces."""
        clip = torch.cat([cond["clip_1"], cond["clip_2"]], dim=-1)
        t5 = cond.get("t5")
        if t5 is None:
            t5 = clip.new_zeros((clip.shape[0], self.max_sequence_length, self.transformer.config.joint_attention_dim))
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([cond["pooled_1"], cond["pooled_2"]], dim=-1)

    # -- 2. latents and timesteps -----------------------------------------------------------------------

    def _timesteps(
        self, num_steps: int, image_seq_len: int, flow_shift: float | None = None
    ) -> tuple[Any, torch.Tensor]:
        """A private scheduler with this shape's timesteps (the set-up is cached per shape and shift)."""

        def build() -> tuple[Any, torch.Tensor]:
            template = recipe.scheduler_template(self.scheduler, flow_shift)
            kwargs: dict[str, Any] = {}
            if template.config.get("use_dynamic_shifting", None):
                kwargs["mu"] = recipe.dynamic_shift_mu(template.config, image_seq_len, max_shift=1.16)
            return template, retrieve_timesteps(template, num_steps, self.device, **kwargs)[0]

        return recipe.cached_schedule(self._schedulers, (num_steps, image_seq_len, flow_shift), build)

    def step_extras(self, states: Sequence[DenoiseState]) -> dict[str, Any]:
        """No extras but each state's ControlNet rows (continuous steps)."""
        control = merge_rows([s.extras for s in states], [s.latents.shape[0] for s in states])
        return states[0].extras if control is None else {EXTRAS_KEY: control}

    def prepare(self, batch: Sequence[Any], head: Any, positive: Cond) -> DenoiseState:
        """Noise row j of a request from `seed + j`, in the text embeddings' dtype as diffusers; the schedule. Edits
        (an input image, with or without a mask) start from their re-noised image instead (`prepare_edit_latents`)."""
        lh, lw = head.height // self.vae_scale_factor, head.width // self.vae_scale_factor
        dtype = self._join(positive)[0].dtype
        scheduler, timesteps = self._timesteps(
            head.num_inference_steps, (lh // self.patch_size) * (lw // self.patch_size), head.flow_shift
        )
        if head.image_inputs:
            latents, timesteps, masked = self.prepare_edit_latents(batch, scheduler, timesteps, dtype)
            extras = {} if masked is None else {inpaint.EXTRAS_KEY: masked}
        else:
            latents = recipe.batch_noise(
                batch, (self.transformer.config.in_channels, lh, lw), device=self.device, dtype=dtype
            )
            extras = {}
        control = sd3_controlnet.prepare_control(
            self, batch, head.height, head.width, timesteps, self.guidance_rule.runs(head)
        )
        if control is not None:
            extras[EXTRAS_KEY] = control
        return DenoiseState(latents=latents, timesteps=timesteps, scheduler=scheduler, extras=extras)

    # -- edits: image-to-image and inpainting (pipelines/inpaint.py) --------------------------------------------

    def prepare_edit_latents(
        self, batch: Sequence[Any], scheduler: Any, timesteps: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, inpaint.InpaintRows | None]:
        """Each request's image, VAE-encoded and re-noised to `strength`, as diffusers' SD3 pipelines start.

        StableDiffusion3InpaintPipeline (a mask) and StableDiffusion3Img2ImgPipeline (none) start alike: the image
        encoded once, sampled with row 0's generator (the img2img pipeline's per-row encode finds one image row, so
        its other generators draw nothing there), then one noise row per output from the row generators; the
        schedule starts at `steps - steps * strength`."""
        head = batch[0]
        full, timesteps = timesteps, inpaint.batch_schedule(batch, scheduler, timesteps)
        rows, clean, noises, sources = [], [], [], []
        for params in batch:
            generators = [torch.Generator("cpu").manual_seed(s) for s in recipe.row_seeds(params)]
            source = inpaint.request_source(params, self.image_processor, self.mask_processor, head.height, head.width)
            pixels = source.pixels.to(self.device, dtype)
            encoded = retrieve_latents(self.vae.encode(pixels), generator=generators[0])
            image_latents = (encoded - self.vae.config.shift_factor) * self.vae.config.scaling_factor
            image_latents = image_latents.expand(params.n, -1, -1, -1).to(dtype)
            noise = randn_tensor(image_latents.shape, generator=generators, device=self.device, dtype=dtype)
            rows.append(inpaint.start_latents(scheduler, params, full, image_latents, noise))
            clean.append(image_latents)
            noises.append(noise)
            sources.append(source)
        latents = torch.cat(rows)
        if not inpaint.any_mask(batch):
            return latents, timesteps, None
        clean_rows = torch.cat(clean)
        masks = [
            inpaint.latent_mask(source.mask, tuple(clean_rows.shape[2:]), clean_rows).expand(params.n, -1, -1, -1)
            for params, source in zip(batch, sources, strict=True)
        ]
        overlays = [source.overlay for params, source in zip(batch, sources, strict=True) for _ in range(params.n)]
        return latents, timesteps, inpaint.InpaintRows(torch.cat(masks), clean_rows, torch.cat(noises), overlays)

    def scheduler_step(
        self, noise_pred: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor, state: DenoiseState
    ) -> torch.Tensor:
        """The scheduler's step, then (inpainting rows) the kept region put back."""
        return inpaint.blended_step(noise_pred, timestep, latents, state)

    # -- 3. the transformer call ------------------------------------------------------------------------

    def predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState, model_key: str
    ) -> torch.Tensor:
        if "packed" in state.extras:
            return self.predict_packed(latents, timestep, cond, state)
        prompt_embeds, pooled = self._join(cond)
        control = sd3_controlnet.controlnet_kwargs(self, latents, timestep, prompt_embeds, pooled, state.extras)
        return self.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            return_dict=False,
            **control,
        )[0]

    # -- 4. decode --------------------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor, state: DenoiseState) -> list[Image.Image]:
        """Unscale, VAE-decode, and round as diffusers' image processor does."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return inpaint.apply_overlays(recipe.to_pil_images(image), state, self.image_processor)

    # -- packed mixed-size calls (pipelines/packing.py) -------------------------------------------------------

    def packed_layout(self, groups: list[packing.SizeGroup], positive: Cond) -> packing.PackedRows:
        """[image patches, CLIP + T5 text] per row; the text is one fixed length (CLIP's 77 + T5's, unmasked as
        in diffusers), the patches differ by size. SD3's processor calls SDPA itself: the key mask is SDPA's."""
        text = self._join(positive)[0].shape[1]
        patches = [self._patches(g) for g in groups for _ in range(g.rows.stop - g.rows.start)]
        return packing.PackedRows((text,) * len(patches), tuple(patches), text, max(patches), text_first=False)

    def _patches(self, group: packing.SizeGroup) -> int:
        _, height, width = group.spatial or (0, 0, 0)
        return (height // self.patch_size) * (width // self.patch_size)

    def predict_packed(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState
    ) -> torch.Tensor:
        """One transformer call over rows of different sizes: each size group patch-embedded on its own grid (its
        own cropped position table), the patches padded and handed to the blocks in place of the patch embedding
        of a stand-in canvas, the padding masked in every attention, and the output unpatchified per group."""
        packing.install_masked_sdpa("diffusers.models.attention_processor")
        packed: packing.Packed = state.extras["packed"]
        layout, groups = packed.layout, packed.groups
        spans = [(g, g.rows.start + k * layout.rows) for k in range(latents.shape[0] // layout.rows) for g in groups]
        embed = self.transformer.pos_embed
        tokens = [embed(g.latents_of(latents[start : start + g.rows.stop - g.rows.start])) for g, start in spans]
        embedded = packing.pad_tokens(tokens, layout.max_image)
        largest = max(groups, key=self._patches).spatial
        canvas = latents.new_zeros(latents.shape[0], *largest)  # its shape gives the call max_image patches
        captured: list[torch.Tensor] = []
        hooks = (
            embed.register_forward_hook(lambda module, args, out: embedded),
            self.transformer.proj_out.register_forward_hook(lambda module, args, out: captured.append(out)),
        )
        prompt_embeds, pooled = self._join(cond)
        try:
            with layout.active():
                self.transformer(
                    hidden_states=canvas,
                    timestep=timestep,
                    encoder_hidden_states=prompt_embeds,
                    pooled_projections=pooled,
                    return_dict=False,
                )
        finally:
            for hook in hooks:
                hook.remove()
        return packing.pad_tokens([self._unpatchify(captured[0], g, start) for g, start in spans], latents.shape[1])

    def _unpatchify(self, out: torch.Tensor, group: packing.SizeGroup, start: int) -> torch.Tensor:
        """A group's rows of the final projection's patches -> its velocity, as (rows, h x w, channels) tokens
        (diffusers' unpatchify of SD3Transformer2DModel.forward, on the group's own grid)."""
        p, channels = self.patch_size, self.transformer.out_channels
        _, height, width = group.spatial or (0, 0, 0)
        rows = out[start : start + group.rows.stop - group.rows.start, : self._patches(group)]
        rows = rows.reshape(rows.shape[0], height // p, width // p, p, p, channels)
        image = torch.einsum("nhwpqc->nchpwq", rows).reshape(rows.shape[0], channels, height, width)
        return image.flatten(2).transpose(1, 2)
