"""The Qwen-Image maths our adapters share with diffusers, step for step (so outputs match it).

`QwenImagePipeline` (Qwen-Image, 2512) and `QwenImage21Pipeline` (2.1), diffusers 0.42.1:

Qwen-Image
- text: each prompt goes into `prompt_template_encode` (a system prompt asking for a detailed
  description, then the user turn); the Qwen2.5-VL encoder's last hidden state is cut to the
  attention mask, its first `prompt_template_encode_start_idx` (34) tokens (the system prefix) are
  dropped, and at most `max_sequence_length` (512) tokens are kept. A batch is right-padded to its
  longest prompt with a 0/1 mask; a mask with no padding is passed as None.
- true CFG: on when `true_cfg_scale > 1` and a negative prompt is given; the two branches run as
  separate transformer calls, combined as `neg + s * (cond - neg)`, then rescaled per token so the
  combined prediction keeps the conditional prediction's norm (over the channel dimension).
- latents: noise of shape (rows, 1, C, 2*(H//16), 2*(W//16)), packed into 2x2 patches (4C channels
  per token); `img_shapes = (1, H//16, W//16)`.
- timesteps: `sigmas = linspace(1, 1/N, N)` and `mu = calculate_shift(tokens, ...)` from the
  scheduler config (exponential time shift, terminal shift 0.02 in the published config); the
  transformer reads `timestep / 1000`.
- decode: unpack to (rows, C, 1, h, w), `latents / (1 / std) + mean`, VAE decode, first frame,
  `(x / 2 + 0.5).clamp(0, 1)`, `round(x * 255)` to uint8.

Qwen-Image 2.1
- text: `prompt_template_t2i` (system "Comprehend and analyze the provided prompt."); the Qwen3-VL
  processor left-pads; the hidden state read is the last decoder layer BEFORE the final norm
  (diffusers hooks the norm away); the system-message tokens (length from the chat template) are
  dropped. An empty prompt is encoded as " ".
- true CFG without rescaling; default `true_cfg_scale` 1 (guidance off).
- latents unpatched: (rows, 1, C, 2*(H//32), 2*(W//32)) flattened to tokens; sizes are multiples
  of 32 (16x VAE, and the encoder's image slots stand for 2x2 latent tokens).
- the single-stream block-causal transformer takes `img_mask` (text slots False, one True slot per
  2x2 target tokens) and a prefix KV cache filled on step 0 ("extract") and read later ("cached").
- decode: `latents * std + mean`, otherwise as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffuserve.pipelines import packing
from diffuserve.pipelines.batch_rows import Cond, DenoiseState


def masked_rows(hidden: torch.Tensor, mask: torch.Tensor, drop: int, limit: int | None = None) -> list[torch.Tensor]:
    """Per text: its valid hidden states (mask == 1), minus the first `drop`, at most `limit` kept."""
    rows = [h[m.bool()][drop:] for h, m in zip(hidden, mask, strict=True)]
    return rows if limit is None else [r[:limit] for r in rows]


def pad_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad variable-length (L_i, D) rows with zeros: (embeds (T, L, D), mask (T, L) long)."""
    longest = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=embeds.device)
    for i, r in enumerate(rows):
        mask[i, : r.shape[0]] = 1
    return embeds, mask


def groups_by_length(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Indices grouped by equal length (in first-seen order): batches that need no padding."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(int(n), []).append(i)
    return groups


def norm_rescaled_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG: the CFG combination rescaled to the conditional prediction's norm
    per token (diffusers' operand order, so results match bit for bit)."""
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


def latents_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latents mean and std, shaped (1, C, 1, 1, 1) like `like`."""
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    return mean, std


# -- packed mixed-size calls (pipelines/packing.py) -----------------------------------------------------------

MODULE = "diffusers.models.transformers.transformer_qwenimage"


class QwenPacking:
    """Mixed into `QwenImageAdapter`: the packed layout and the packed transformer call."""

    transformer: Any
    device: torch.device
    packs_split = True

    recipe: Any

    def packed_layout(self, groups: list[packing.SizeGroup], positive: Cond) -> packing.PackedRows:
        """[text, image] per row: each row's own text length (the mask's) and its size's image tokens."""
        text = [int(n) for n in positive["mask"].sum(dim=1).tolist()]
        image = [g.tokens for g in groups for _ in range(g.rows.stop - g.rows.start)]
        kernel = packing.packed_kernel(self.device, split=self.recipe.active_split() is not None)
        return packing.PackedRows(tuple(text), tuple(image), positive["mask"].shape[1], max(image), kernel=kernel)

    def predict_packed(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState
    ) -> torch.Tensor:
        """One call over rows of different sizes: each size's RoPE tables (its image grid, and its text positions,
        which start past its grid) stacked per row in place of the batch's one table, the image padding masked
        beside the text padding, per-row modulation as diffusers broadcasts it. Under sequence parallel each row's
        image table is cut to the rank's share inside the call, as the hidden states are."""
        packing.install_row_rotary(MODULE, "apply_rotary_emb_qwen")
        packing.install_masked_dispatch(MODULE)
        packed: packing.Packed = state.extras["packed"]
        layout, split = packed.layout, self.recipe.active_split()
        repeats = latents.shape[0] // layout.rows
        text = cond["embeds"].shape[1]
        image_rows, text_rows = [], []
        for g in packed.groups:
            image, txt = self.transformer.pos_embed(
                g.state.extras["img_shapes"][0], latents.device, max_txt_seq_len=text
            )
            image = torch.nn.functional.pad(image, (0, 0, 0, layout.max_image - image.shape[0]))
            image_rows += [image] * (g.rows.stop - g.rows.start)
            text_rows += [txt] * (g.rows.stop - g.rows.start)
        tables = (torch.stack(image_rows * repeats), torch.cat(text_rows * repeats))

        def per_row(module: torch.nn.Module, args: tuple, out: Any) -> tuple:
            image = tables[0] if split is None else split.shard_tokens(tables[0], 1)
            return image.flatten(0, 1), tables[1]

        hook = self.transformer.pos_embed.register_forward_hook(per_row)
        guidance, mask = packed.groups[0].state.extras["guidance"], cond["mask"]
        # The largest size's shapes: diffusers' own table then has the call's token count (the split cuts it).
        largest = max(packed.groups, key=lambda g: g.tokens)
        try:
            with layout.active():
                out = self.transformer(
                    hidden_states=latents,
                    timestep=timestep.to(latents.dtype) / 1000,
                    guidance=None if guidance is None else guidance.expand(latents.shape[0]),
                    encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                    encoder_hidden_states=cond["embeds"],
                    img_shapes=largest.state.extras["img_shapes"][:1] * latents.shape[0],
                    return_dict=False,
                )[0]
        finally:
            hook.remove()
        return out * layout.image_mask(repeats, out.device)[..., None].to(out.dtype)
