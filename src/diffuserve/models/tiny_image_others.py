"""Tiny checkpoints of the image families served through the diffusers backend: ERNIE-Image
(`ErnieImagePipeline`), Qwen-Image-Layered (`QwenImageLayeredPipeline`) and GLM-Image (`GlmImagePipeline`).

Random weights, real configs shrunk, a fixed seed per component (so every build writes the same bytes) and
offline tokenizers; each folder loads with `<PipelineClass>.from_pretrained(dir, local_files_only=True)`.
Tokenizers and small encoders are the ones the native families' tiny builders already make (FLUX.2's
Mistral tokenizer, Qwen-Image's Qwen2 tokenizer and Qwen2.5-VL encoder): one place per fact.

Every import of torch / diffusers / transformers is inside a function: the family specs import this
module's path, not its code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.models.tiny import write_defaults

TINY_DEFAULTS = {"width": 64, "height": 64, "num_inference_steps": 2}
"""Request defaults the tiny checkpoints suggest (written into model_index.json)."""


def _save(pipe: Any, output_dir: Path, defaults: dict[str, Any] = TINY_DEFAULTS) -> None:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, defaults)


# -- ERNIE-Image ---------------------------------------------------------------------------------------

ERNIE_TEXT_HIDDEN = 16
"""Hidden width of the tiny Mistral3 text encoder (= the transformer's `text_in_dim`)."""


def _ernie_text_encoder(vocab_size: int, pad_token_id: int) -> Any:
    """ERNIE-Image's text encoder: a `Mistral3Model` (the pipeline reads its second-to-last hidden state)."""
    from transformers import Mistral3Config, Mistral3Model

    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": vocab_size,
            "hidden_size": ERNIE_TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 256,
            "pad_token_id": pad_token_id,
        },
        # The pipeline never feeds images; the vision tower is as small as it gets.
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "head_dim": 8,
            "image_size": 32,
            "patch_size": 8,
        },
        image_token_index=0,
        spatial_merge_size=2,
    )
    return Mistral3Model(config)


def build_ernie_image(output_dir: Path) -> None:
    """`make-tiny --family ernie-image`: Mistral3 encoder, ERNIE-Image DiT, FLUX.2's VAE (2x2-patchified latents)."""
    import torch
    from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler

    from diffuserve.models.tiny_flux2 import LATENT_CHANNELS, _vae, build_mistral_tokenizer

    tokenizer = build_mistral_tokenizer()
    torch.manual_seed(901)
    text_encoder = _ernie_text_encoder(len(tokenizer), tokenizer.pad_token_id).eval()
    torch.manual_seed(902)
    # Head dim 16 split over the RoPE axes (text/frame, row, column) like the published (32, 48, 48) of 128.
    transformer = ErnieImageTransformer2DModel(
        hidden_size=32,
        num_attention_heads=2,
        num_layers=2,
        ffn_hidden_size=64,
        in_channels=4 * LATENT_CHANNELS,
        out_channels=4 * LATENT_CHANNELS,
        text_in_dim=ERNIE_TEXT_HIDDEN,
        rope_axes_dim=(4, 6, 6),
    ).eval()
    torch.manual_seed(903)
    vae = _vae().eval()
    # The pipeline sets its own linear sigmas; the scheduler is the plain flow-matching Euler one.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = ErnieImagePipeline(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
    )
    _save(pipe, output_dir)


# -- Qwen-Image-Layered --------------------------------------------------------------------------------

def build_qwen_image_layered(output_dir: Path) -> None:
    """`make-tiny --family qwen-image-layered`: Qwen-Image's layout with an RGBA VAE and the layered DiT.

    The pipeline resizes the input image to a 640x640 (or 1024x1024) area by rule, so the VAE is the
    16x-compressing five-level one of the tiny Qwen-Image-Edit (a 40x40 latent per layer at 640 px). The
    VAE takes and returns RGBA (`input_channels=4`), and the transformer has the layered model's extra
    timestep condition and 3D (layer, row, column) RoPE, as in the published Qwen-Image-Layered config.
    """
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageLayeredPipeline, QwenImageTransformer2DModel

    from diffuserve.models import tiny_qwen_image_edit as edit
    from diffuserve.models.tiny_qwen_image import _qwen25_vl_encoder, build_qwen2_tokenizer

    # 8 latent channels, not 4: the pipeline takes an input whose channel count equals z_dim for latents, and an
    # RGBA image has 4.
    z_dim = 8
    tokenizer = build_qwen2_tokenizer(model_max_length=1024)
    text_encoder = _qwen25_vl_encoder(tokenizer, edit.TEXT_HIDDEN, 911)
    torch.manual_seed(912)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=edit.TEXT_HIDDEN,
        axes_dims_rope=(4, 6, 6),
        use_additional_t_cond=True,
        use_layer3d_rope=True,
    ).eval()
    torch.manual_seed(913)
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=0,
        temperal_downsample=[False, True, True, False],
        input_channels=4,
        latents_mean=[0.1, -0.2, 0.05, 0.3, -0.1, 0.2, 0.0, -0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0, 1.1, 0.9, 1.3, 1.0],
    ).eval()
    pipe = QwenImageLayeredPipeline(
        scheduler=edit._scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=edit.build_processor(build_qwen2_tokenizer(model_max_length=1024)),
        transformer=transformer,
    )
    _save(pipe, output_dir)
