"""FLUX.2 / Klein packed mixed-size calls (`pipelines/packing.py`), beside the adapter: the FLUX.1 recipe (per-row
RoPE tables stacked, a key mask or flex block mask over each row's latent padding) on FLUX.2's 4-axis ids."""

from __future__ import annotations

from typing import Any

import torch

from diffuserve.pipelines import packing
from diffuserve.pipelines.batch_rows import Cond, DenoiseState

MODULE = "diffusers.models.transformers.transformer_flux2"


class Flux2Packing:
    """Mixed into `Flux2Adapter`: the packed layout, the stacked ids and the packed transformer call."""

    transformer: Any
    device: torch.device

    def packed_layout(self, groups: list[packing.SizeGroup], positive: Cond) -> packing.PackedRows:
        """[text, image] per row: the text one padded length for every row (attended unmasked, as diffusers);
        the image tokens differ by size."""
        text = positive["prompt_embeds"].shape[1]
        image = [g.tokens for g in groups for _ in range(g.rows.stop - g.rows.start)]
        kernel = packing.packed_kernel(self.device)
        return packing.PackedRows((text,) * len(image), tuple(image), text, max(image), kernel=kernel)

    def packed_extras(self, groups: list[packing.SizeGroup], layout: packing.PackedRows, positive: Cond) -> dict:
        """Each row's ids ([its text ids, its size's image ids, zeros for the padding]), stacked."""
        ids = []
        for g in groups:
            text_ids, image_ids = g.state.extras["txt_ids"], g.state.extras["img_ids"]
            pad = image_ids.new_zeros(layout.max_image - image_ids.shape[0], image_ids.shape[-1])
            ids += [torch.cat([text_ids, image_ids, pad])] * (g.rows.stop - g.rows.start)
        return {"ids": torch.cat(ids), "guidance": groups[0].state.extras["guidance"]}

    def predict_packed(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Cond, state: DenoiseState) -> Any:
        """One transformer call over rows of different sizes (see the module docstring)."""
        packing.install_row_rotary(MODULE)
        layout: packing.PackedRows = state.extras["packed"].layout
        repeats = latents.shape[0] // layout.rows  # 2 for a doubled CFG batch
        ids = state.extras["ids"].repeat(repeats, 1)
        guidance = state.extras["guidance"]
        with layout.active():
            out = self.transformer(
                hidden_states=latents.to(self.transformer.dtype),
                timestep=timestep.to(latents.dtype) / 1000,
                guidance=None if guidance is None else guidance.expand(latents.shape[0]),
                encoder_hidden_states=cond["prompt_embeds"],
                txt_ids=ids[:0],
                img_ids=ids,
                joint_attention_kwargs={"attention_mask": layout.attention_mask(repeats, latents.device)},
                return_dict=False,
            )[0]
        return out * layout.image_mask(repeats, out.device)[..., None].to(out.dtype)
