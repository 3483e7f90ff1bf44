"""Tiny HunyuanVideo 1.5 checkpoints: text-to-video and image-to-video.

Random weights over the real layouts scaled down (Qwen2.5-VL text model with a ChatML template, ByT5 glyph encoder,
the 1.5 transformer, its causal VAE, the CFG guider; I2V adds a SigLIP vision encoder and its image processor), one
fixed seed per component (two builds write the same bytes), saved in the exact diffusers layout. Each suggests small
request defaults (`write_defaults`) so a video job on CPU takes about a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffuserve.models.tiny import write_defaults
from diffuserve.models.tiny_parts import BIGRAMS, tiny_t5_config

SEED = 900
"""Base seed of the components (the range the backend-era builder used, so the T2V bytes stay comparable)."""

HUNYUAN_15_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
"""What the tiny checkpoints suggest (2k+1 frames: the tiny VAE compresses time 2x; sizes are multiples of 4)."""


def _qwen_tokenizer() -> Any:
    """A byte-level Qwen2 tokenizer over the CLIP bytes + bigrams, with the Qwen chat specials and a minimal
    ChatML template (HunyuanVideo 1.5 encodes prompts with `apply_chat_template`)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(alphabet)
    merges = [(p[0], p[1]) for p in BIGRAMS]
    tokens += list(BIGRAMS)
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def _t2v_components() -> dict[str, Any]:
    """The text-to-video parts (shared by the I2V layout, whose transformer differs only in `task_type`)."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    qwen_tok = _qwen_tokenizer()
    byt5_tok = ByT5Tokenizer()
    torch.manual_seed(SEED + 11)
    qwen = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(qwen_tok),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=qwen_tok.eos_token_id,
            eos_token_id=qwen_tok.eos_token_id,
            pad_token_id=qwen_tok.pad_token_id,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        )
    ).eval()
    torch.manual_seed(SEED + 12)
    byt5 = T5EncoderModel(T5Config(**{**tiny_t5_config(byt5_tok, 32), "vocab_size": len(byt5_tok)})).eval()
    torch.manual_seed(SEED + 13)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        text_embed_2_dim=32,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=32,
        task_type="t2v",
    ).eval()
    torch.manual_seed(SEED + 14)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    ).eval()
    return {
        "text_encoder": qwen,
        "tokenizer": qwen_tok,
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "text_encoder_2": byt5,
        "tokenizer_2": byt5_tok,
        "guider": ClassifierFreeGuidance(guidance_scale=1.0),
    }


def build_hunyuan_video_15(output_dir: Path) -> None:
    """HunyuanVideo 1.5 T2V layout: Qwen2.5-VL text model (chat template), ByT5 glyph encoder, the 1.5
    transformer (`task_type="t2v"`), its VAE (4x space, 2x time at this size) and a CFG guider."""
    from diffusers import HunyuanVideo15Pipeline

    HunyuanVideo15Pipeline(**_t2v_components()).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, HUNYUAN_15_TINY_DEFAULTS)


def build_hunyuan_video_15_i2v(output_dir: Path) -> None:
    """HunyuanVideo 1.5 I2V layout: the T2V parts with an `i2v` transformer, plus a SigLIP vision encoder (its last
    hidden states are the transformer's image tokens, `image_embed_dim` wide) and its image processor."""
    import torch
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Transformer3DModel
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    parts = _t2v_components()
    config = dict(parts["transformer"].config)
    config.update(task_type="i2v")
    torch.manual_seed(SEED + 15)
    parts["transformer"] = HunyuanVideo15Transformer3DModel.from_config(config).eval()
    torch.manual_seed(SEED + 16)
    vision = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=config["image_embed_dim"],
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    ).eval()
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=vision, feature_extractor=processor).save_pretrained(
        output_dir, safe_serialization=True
    )
    # Without torchvision transformers saves its PIL fallback class; name the upstream class (which loads the same
    # preprocessor_config.json, falling back to the PIL class where torchvision is missing).
    index_file = output_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_defaults(output_dir, HUNYUAN_15_TINY_DEFAULTS)
