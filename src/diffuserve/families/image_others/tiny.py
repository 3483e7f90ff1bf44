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

    from diffuserve.families.flux2.tiny import LATENT_CHANNELS, build_mistral_tokenizer, build_vae

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
    vae = build_vae().eval()
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

    from diffuserve.families.qwen_image.tiny import build_qwen2_tokenizer, build_qwen25_vl_encoder
    from diffuserve.families.qwen_image_edit import tiny as edit
    from diffuserve.models.tiny_parts import qwen_image_scheduler

    # 8 latent channels, not 4: the pipeline takes an input whose channel count equals z_dim for latents, and an
    # RGBA image has 4.
    z_dim = 8
    tokenizer = build_qwen2_tokenizer(model_max_length=1024)
    text_encoder = build_qwen25_vl_encoder(tokenizer, edit.TEXT_HIDDEN, 911)
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
        scheduler=qwen_image_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=edit.build_processor(build_qwen2_tokenizer(model_max_length=1024)),
        transformer=transformer,
    )
    _save(pipe, output_dir)


# -- GLM-Image -----------------------------------------------------------------------------------------

GLM_CODEBOOK = 128
"""Image-token codebook of the tiny AR model (real GLM-Image: 16384); ids `GLM_CODEBOOK` and `+ 1` are the
image start / end tokens, so the AR head covers `GLM_CODEBOOK + 2` ids (`vision_vocab_size`) as upstream."""

_GLM_SPECIALS = ("[gMASK]", "<sop>", "<eop>", "<|user|>", "<|assistant|>", "<|image|>", "<|endoftext|>")
_GLM_CHAT_TEMPLATE = (
    "[gMASK]{%- for message in messages %}<|{{ message['role'] }}|>\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}<|dit_token_"
    + str(GLM_CODEBOOK)
    + "|><|image|><|dit_token_"
    + str(GLM_CODEBOOK + 1)
    + "|>"
    "{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{%- endfor %}<|assistant|>\n"
)
"""GLM-style chat rendering: one user turn, image parts as start / placeholder / end tokens (what the processor
expands), then the assistant marker; the processor appends the target grids and the image-start token."""


def _glm_tokenizer() -> Any:
    """The AR model's tokenizer: image tokens first (ids 0..codebook+1, as the AR head numbers them), GLM's
    chat markers, then the tiny byte-level BPE; left padding, as batched generation needs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import TokenizersBackend

    from diffuserve.models.tiny_parts import byte_bpe_vocab

    image_tokens = tuple(f"<|dit_token_{i}|>" for i in range(GLM_CODEBOOK + 2))
    specials = image_tokens + _GLM_SPECIALS
    vocab, merges = byte_bpe_vocab(specials)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token=image_tokens[GLM_CODEBOOK],
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=512,
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
    )


def _glm_processor() -> Any:
    from transformers import GlmImageProcessor
    from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

    # 16-pixel patches merged 2x2: one AR image token per 32 px, as the d32 prior tokens upstream.
    image_processor = GlmImageImageProcessorPil(
        patch_size=16, merge_size=1, temporal_patch_size=1, min_pixels=32 * 32, max_pixels=128 * 128
    )
    return GlmImageProcessor(
        image_processor=image_processor, tokenizer=_glm_tokenizer(), chat_template=_GLM_CHAT_TEMPLATE
    )


def _glm_ar_model(tokenizer: Any) -> Any:
    """The AR model (`GlmImageForConditionalGeneration`): 2 text layers, a 1-block vision tower and VQ."""
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration

    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
            "vision_vocab_size": GLM_CODEBOOK + 2,
            # head dim 16 -> 8 rotary pairs over (t, h, w), as the published split of 64.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            "pad_token_id": end_of_text,
            # Outside the AR head's range, so generation always runs to max_new_tokens (a random model would
            # otherwise sample the image-end token early and leave the grid short).
            "eos_token_id": end_of_text,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 2,
            "image_size": 32,
            "patch_size": 16,
            "intermediate_size": 16,
        },
        vq_config={"embed_dim": 16, "num_embeddings": GLM_CODEBOOK, "latent_channels": 16},
        image_token_id=tokenizer.convert_tokens_to_ids("<|image|>"),
        image_start_token_id=GLM_CODEBOOK,
        image_end_token_id=GLM_CODEBOOK + 1,
    )
    return GlmImageForConditionalGeneration(config)


def build_glm_image(output_dir: Path) -> None:
    """`make-tiny --family glm-image`: the AR model + `GlmImageProcessor`, ByT5 glyph encoder, GLM-Image DiT, VAE."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        GlmImagePipeline,
        GlmImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    from diffuserve.models.tiny_parts import tiny_t5_config

    processor = _glm_processor()
    glyph_tokenizer = ByT5Tokenizer()
    torch.manual_seed(921)
    vision_language_encoder = _glm_ar_model(processor.tokenizer).eval()
    torch.manual_seed(922)
    text_encoder = T5EncoderModel(T5Config(**tiny_t5_config(glyph_tokenizer, 32))).eval()
    torch.manual_seed(923)
    # patch 2 x VAE factor 8 = 16 px per DiT token: the AR's d32 tokens upsampled 2x, as upstream.
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=32,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=GLM_CODEBOOK + 2,
    ).eval()
    torch.manual_seed(924)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
        latents_mean=[0.1, -0.1, 0.05, 0.0],
        latents_std=[1.2, 0.9, 1.1, 1.0],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        time_shift_type="linear",
    )
    pipe = GlmImagePipeline(
        tokenizer=glyph_tokenizer,
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=vision_language_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
    _save(pipe, output_dir)
