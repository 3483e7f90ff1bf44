"""Tiny Qwen-Image checkpoints, built offline: `QwenImagePipeline` (Qwen-Image, 2512) and `QwenImage21Pipeline`
(Qwen-Image 2.1) layouts.

Random weights, real configs scaled down, and an offline byte-level BPE `Qwen2Tokenizer` whose
vocabulary holds every word of the pipeline's prompt template, so the template's system prefix is
exactly the 34 tokens diffusers drops (`prompt_template_encode_start_idx`), as with the real
tokenizer. The scheduler is the published Qwen-Image one (exponential dynamic shift, 8192 tokens,
terminal shift 0.02), so `mu` and the timesteps follow the real model's rule.

Every import of torch / diffusers / transformers is inside a function: the family spec imports
this module's path, not its code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.models.tiny import write_defaults

QWEN_IMAGE_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
"""`scheduler_config.json` of the published Qwen-Image checkpoints (also Qwen-Image 2512)."""

TINY_DEFAULTS = {"width": 64, "height": 64, "num_inference_steps": 4}
"""Request defaults the tiny checkpoints suggest (the real model's 1024x1024 / 50 steps is slow here)."""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen chat/vision special tokens, in the order the real vocabulary numbers them."""

_TEMPLATE_WORDS = (
    # Qwen-Image's prompt template (system prefix and chat roles).
    "system user assistant Describe the image by detailing color shape size texture quantity text "
    "spatial relationships of objects and background "
    # Qwen-Image 2.1's system prompt.
    "Comprehend analyze provided prompt Picture "
    # Words the tests and examples use, so different prompts give different token ids.
    "a an cat dog bird fish tree house city sky sea sun moon red blue green yellow black white small "
    "big old new photo painting portrait landscape surfing wave mountain river forest night day light "
    "dark style detailed high quality art blurry low ugly with in on at under over"
).split()


def qwen_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE: the 256 byte symbols, plus each template word as one token (with and without
    its leading-space marker), built by left-to-right merge chains.

    The chains of space-prefixed words come first: their pairs all contain the `Ġ` marker, so no
    chain of a bare word can fire inside them, and each listed word ends as a single token.
    """
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    words = [f"\u0120{w}" for w in dict.fromkeys(_TEMPLATE_WORDS)] + list(dict.fromkeys(_TEMPLATE_WORDS))
    for word in words:
        for i in range(1, len(word)):
            pair = (word[:i], word[i])
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
                tokens.append(word[: i + 1])
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    return vocab, merges


def build_qwen2_tokenizer(model_max_length: int = 131072) -> Any:
    """The offline `Qwen2Tokenizer` of the tiny checkpoints (special tokens numbered after the vocabulary)."""
    from transformers import Qwen2Tokenizer

    vocab, merges = qwen_vocab_and_merges()
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        padding_side="right",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def build_qwen25_vl_encoder(tokenizer: Any, hidden: int, seed: int) -> Any:
    """A 2-layer Qwen2.5-VL (text + a 1-block vision tower) over `tokenizer`'s vocabulary."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # head_dim 16 -> 8 rotary pairs split over (t, h, w) like the 7B's [16, 24, 24] of 64.
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [0],
            "window_size": 28,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_image_components(*, seed: int = 0) -> dict[str, Any]:
    """The five components of a tiny `QwenImagePipeline`."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    hidden = 32
    z_dim = 4
    tokenizer = build_qwen2_tokenizer()
    text_encoder = build_qwen25_vl_encoder(tokenizer, hidden, seed + 1)
    torch.manual_seed(seed + 2)
    # 2 MM-DiT blocks (so layer-wise offload has more than one block to move); head dim 16 split
    # over the RoPE axes (frame, row, column) like the real (16, 56, 56) of 128.
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=hidden,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    torch.manual_seed(seed + 3)
    # 8x spatial compression as upstream (three downsamples), narrow channels, the real mean/std
    # of the first z_dim latent channels.
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def build_qwen_image(output_dir: Path) -> None:
    """`make-tiny --family qwen-image`: a tiny Qwen-Image checkpoint (QwenImagePipeline layout)."""
    from diffusers import QwenImagePipeline

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    QwenImagePipeline(**qwen_image_components()).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, TINY_DEFAULTS)


# -- Qwen-Image 2.1 ----------------------------------------------------------------------------------

QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template rendering messages as Qwen3-VL's does (what `QwenImage21Pipeline` reads its
system-prefix length from)."""

QWEN3_VL_VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
"""The `video_processor` entry written into processor_config.json, so the real `Qwen3VLProcessor`
(where torchvision exists) finds its video processor; the text-to-image path never uses it."""


def build_qwen3_vl_processor(tokenizer: Any) -> Any:
    """A `Qwen3VLProcessor` over `tokenizer`, built without torchvision (models/processor_substitutes.py)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffuserve.models.processor_substitutes import install_processor_substitutes

    install_processor_substitutes()
    from transformers import Qwen3VLProcessor

    # Qwen3-VL normalises to [-1, 1] (mean = std = 0.5) with 16-pixel patches.
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE)


def _qwen3_vl_encoder(tokenizer: Any, hidden: int, seed: int) -> Any:
    """A 2-layer Qwen3-VL (text + a 1-block vision tower) over `tokenizer`'s vocabulary."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_interleaved": True,
                "mrope_section": [4, 2, 2],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def qwen_image_21_components(*, seed: int = 0) -> dict[str, Any]:
    """The five components of a tiny `QwenImage21Pipeline` (text-to-image; no sample_sigmas, i.e. base not Turbo)."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Transformer2DModel,
    )

    hidden = 32
    z_dim = 8
    tokenizer = build_qwen2_tokenizer()
    processor = build_qwen3_vl_processor(tokenizer)
    text_encoder = _qwen3_vl_encoder(tokenizer, hidden, seed + 11)
    torch.manual_seed(seed + 12)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=z_dim,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=hidden,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
        causal_condition=True,
    ).eval()
    torch.manual_seed(seed + 13)
    # 16x spatial compression as upstream (four downsamples over five levels).
    vae = AutoencoderKLQwenImage21(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722],
        latents_std=[3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "processor": processor,
        "transformer": transformer,
    }


def build_qwen_image_21(output_dir: Path) -> None:
    """`make-tiny --family qwen-image-2.1`: a tiny Qwen-Image 2.1 checkpoint (QwenImage21Pipeline layout)."""
    import json

    from diffusers import QwenImage21Pipeline

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    QwenImage21Pipeline(**qwen_image_21_components()).save_pretrained(output_dir, safe_serialization=True)
    config_file = output_dir / "processor" / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["video_processor"] = QWEN3_VL_VIDEO_PROCESSOR
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_defaults(output_dir, TINY_DEFAULTS)
