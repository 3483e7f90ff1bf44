"""FLUX.1 packed mixed-size calls (`pipelines/packing.py`), beside the adapter: per-row RoPE tables stacked (applied
per row by `packing.install_row_rotary`), a key mask (or flex block mask) over each row's latent padding, and under
sequence parallel each row's positions cut to the rank's share of the padded sequence (`parallel/sequence.py`)."""

from __future__ import annotations

from typing import Any

import torch

from diffuserve.pipelines import packing
from diffuserve.pipelines.batch_rows import Cond, DenoiseState


class FluxPacking:
    """Mixed into `FluxAdapter`: the packed layout, the stacked ids and the packed transformer call."""

    transformer: Any
    device: torch.device
    _text_ids_for: Any
    _image_ids_for: Any
    packs_split = True

    def packed_layout(self, groups: list[packing.SizeGroup], positive: Cond) -> packing.PackedRows:
        """[T5 text, image] per row: every row's text is the same padded length (T5 pads to its max length and
        FLUX.1 attends to the padding, as diffusers does); the image tokens differ by size."""
        text = positive["prompt_embeds"].shape[1]
        image = [g.tokens for g in groups for _ in range(g.rows.stop - g.rows.start)]
        kernel = packing.packed_kernel(self.device, split=self.recipe.active_split() is not None)
        return packing.PackedRows((text,) * len(image), tuple(image), text, max(image), kernel=kernel)

    recipe: Any

    def packed_extras(
        self, groups: list[packing.SizeGroup], layout: packing.PackedRows, positive: Cond
    ) -> dict[str, object]:
        """Each row's own position ids ([text ids, its size's image ids, zeros for the padding]), stacked."""
        text_ids = self._text_ids_for(layout.max_text)
        ids = []
        for g in groups:
            image_ids = self._image_ids_for(*g.state.extras["size"])
            pad = text_ids.new_zeros(layout.max_image - image_ids.shape[0], 3)
            ids += [torch.cat([text_ids, image_ids, pad])] * (g.rows.stop - g.rows.start)
        return {"ids": torch.cat(ids), "guidance": groups[0].state.extras["guidance"]}

    def predict_packed(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState
    ) -> torch.Tensor:
        """One transformer call over rows of different sizes: per-row RoPE tables (stacked, applied per row by
        `packing.install_row_rotary`), a key mask (or flex block mask) confining each row to its own tokens, and
        the per-row timestep / guidance / pooled modulation diffusers already broadcasts per row."""
        packing.install_row_rotary("diffusers.models.transformers.transformer_flux")
        layout: packing.PackedRows = state.extras["packed"].layout
        repeats = latents.shape[0] // layout.rows  # 2 for a doubled CFG batch
        ids = state.extras["ids"].repeat(repeats, 1)
        guidance = state.extras["guidance"]
        split, hook = self.recipe.active_split(), None
        text_ids, image_ids = ids[:0], ids
        if split is not None:
            text_ids, image_ids, hook = self._split_row_ids(split, layout, ids)
        try:
            with layout.active():
                out = self.transformer(
                    hidden_states=latents,
                    timestep=timestep.to(latents.dtype) / 1000,
                    guidance=None if guidance is None else guidance.expand(latents.shape[0]),
                    pooled_projections=cond["pooled"],
                    encoder_hidden_states=cond["prompt_embeds"],
                    txt_ids=text_ids,
                    img_ids=image_ids,
                    joint_attention_kwargs={"attention_mask": layout.attention_mask(repeats, latents.device)},
                    return_dict=False,
                )[0]
        finally:
            if hook is not None:
                hook.remove()
        return out * layout.image_mask(repeats, out.device)[..., None].to(out.dtype)

    def _split_row_ids(self, split: Any, layout: packing.PackedRows, ids: torch.Tensor) -> tuple[Any, Any, Any]:
        """Sequence parallel on a packed call: the transformer gets row 0's [text ids, image ids] (whose image ids
        the split cuts to this rank's share, as any call's), and its position embedding gets every row's ids, each
        row's image part cut to the same share (`shard_tokens`, inside the call), so each rank rotates its tokens
        with its rows' own positions. Returns (txt_ids, img_ids, the hook to remove after the call)."""
        text = layout.max_text
        rows = ids.view(-1, text + layout.max_image, ids.shape[-1])

        def per_row(module: torch.nn.Module, args: tuple) -> tuple:
            image = split.shard_tokens(rows[:, text:], 1)
            return (torch.cat([rows[:, :text], image], dim=1).flatten(0, 1),)

        hook = self.transformer.pos_embed.register_forward_pre_hook(per_row)
        return rows[0, :text], rows[0, text:], hook
