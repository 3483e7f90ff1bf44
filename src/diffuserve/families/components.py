"""Layer table rows of the model classes many families share (text encoders, image encoders, VAEs).

Each family's own classes (its DiT) are in its spec; `family_spec.layer_rules()` is the union, the ONE table
that the model profiles (layer counts and bytes from safetensors headers) and the layer-wise runtime (which
module lists stream) both read. Paths are suffixes where library versions nest the same encoder differently
(transformers 5 flattens CLIP's `text_model`): `resolve_layer_containers` finds the full path in the module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffuserve.family_spec.base import LayerRules


def num_vae_levels(cfg: dict[str, Any]) -> int:
    """Down/up blocks of an AutoencoderKL: one per `block_out_channels` entry."""
    return len(cfg.get("block_out_channels") or [])


def autoencoder_kl_factor(cfg: Mapping[str, Any]) -> int:
    """Pixels per latent pixel of an AutoencoderKL-style VAE: it halves the side at every level but the last
    (diffusers' `2 ** (len(vae.config.block_out_channels) - 1)`)."""
    return 2 ** (len(cfg["block_out_channels"]) - 1)


_CLIP = (("encoder.layers", "num_hidden_layers"),)
_T5 = (("encoder.block", "num_layers"),)
_DECODER_LM = (("layers", "num_hidden_layers"),)
_VAE_BLOCKS = (("decoder.up_blocks", None), ("encoder.down_blocks", None))

SHARED_LAYER_RULES: LayerRules = {
    "CLIPTextModel": _CLIP,
    "CLIPTextModelWithProjection": _CLIP,
    "CLIPVisionModel": _CLIP,
    "CLIPVisionModelWithProjection": _CLIP,
    "T5EncoderModel": _T5,
    "UMT5EncoderModel": _T5,
    "Qwen2_5_VLForConditionalGeneration": (("language_model.layers", "num_hidden_layers"),),
    "Qwen3VLForConditionalGeneration": (("language_model.layers", "num_hidden_layers"),),
    "Qwen3Model": _DECODER_LM,
    "Qwen3ForCausalLM": (("model.layers", "num_hidden_layers"),),
    "Gemma2Model": _DECODER_LM,
    "Gemma3Model": (("language_model.layers", "num_hidden_layers"),),
    "Gemma3ForConditionalGeneration": (("language_model.layers", "num_hidden_layers"),),
    "LlamaModel": _DECODER_LM,
    "Mistral3ForConditionalGeneration": (("language_model.layers", "num_hidden_layers"),),
    # The decoder first: decode is the serving path, so a resident layer set takes decoder layers.
    "AutoencoderKL": (("decoder.up_blocks", num_vae_levels), ("encoder.down_blocks", num_vae_levels)),
    "AutoencoderKLWan": _VAE_BLOCKS,
    "AutoencoderKLQwenImage": _VAE_BLOCKS,
    "AutoencoderKLQwenImage21": _VAE_BLOCKS,
    "AutoencoderKLFlux2": (("decoder.up_blocks", num_vae_levels), ("encoder.down_blocks", num_vae_levels)),
    "AutoencoderDC": _VAE_BLOCKS,
}
