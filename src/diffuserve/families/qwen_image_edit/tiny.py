"""Tiny Qwen-Image-Edit checkpoints (`QwenImageEditPipeline`, `QwenImageEditPlusPipeline`), built offline.

Both layouts hold the same six components as the published Qwen-Image-Edit / 2509 / 2511 folders:
a Qwen2.5-VL text encoder WITH its vision tower (the edit prompt is encoded together with the input
image), its `Qwen2Tokenizer`, the `Qwen2VLProcessor` that inserts the image tokens, a
`QwenImageTransformer2DModel`, an `AutoencoderKLQwenImage` and the flow-matching scheduler.

Choices that keep the tiny model cheap without changing what the pipeline does:
- The pipelines resize every input image to about 1024x1024 before the VAE encodes it (the edit
  pipeline's target area is fixed in code). The tiny VAE has five levels (16x, not 8x, spatial
  compression) and no residual blocks in its encoder levels, so that encode costs ~1 s on one CPU
  thread instead of 5-30 s, and the image latents add 1024 (not 4096) tokens to the sequence. With
  16x and the pipelines' rounding of the condition size to multiples of 32 every latent side stays
  even, as packing needs.
- The processor's image processor declares min = max = 56*56 pixels, so the vision tower always sees
  a 4x4 patch grid (4 image tokens after the 2x2 merge) whatever the input size.
- The transformer's block weights are scaled up from the default init (see `_transformer`), so the prompt
  and the input images move the output by several levels: a wrong prompt or image shows in a comparison.
- The tokenizer's byte-level vocabulary has whole-word tokens for every piece of the two pipelines'
  prompt templates, so the system prefix is exactly 64 tokens as with the real tokenizer and the
  pipelines' fixed `prompt_template_encode_start_idx = 64` drops exactly that prefix.

Without torchvision `Qwen2VLProcessor` cannot be built (its video processor needs torchvision); the
builder uses `models.processor_substitutes`, and the folder still loads with the real class elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from diffuserve.models.tiny_parts import qwen_image_scheduler

TINY_DEFAULTS = {"width": 64, "height": 64, "num_inference_steps": 2}
"""Request defaults the tiny checkpoints suggest (model_index.json `_diffuserve_defaults`)."""

VISION_PIXELS = 56 * 56
"""min_pixels = max_pixels of the tiny image processor: a 4x4 grid of 14-pixel patches."""

Z_DIM = 4
"""Latent channels of the tiny VAE (the transformer sees 4x this after 2x2 packing)."""

TEXT_HIDDEN = 32
"""Hidden width of the tiny Qwen2.5-VL (= the transformer's joint_attention_dim)."""

_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""The Qwen2.5-VL special tokens the templates and the processor use (ids follow the byte vocabulary)."""


# -- tokenizer ------------------------------------------------------------------------------------------


def _templates() -> list[str]:
    """The prompt templates of both edit pipelines: the text the vocabulary covers with whole tokens."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    texts = []
    for cls in (QwenImageEditPipeline, QwenImageEditPlusPipeline):
        # The templates are set in __init__, which accepts missing components.
        probe = cls(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None)
        texts.append(probe.prompt_template_encode)
    texts.append("Picture 1: Picture 2: Picture 3: ")
    return texts


def _merges_for(pieces: list[str], alphabet: list[str]) -> list[tuple[str, str]]:
    """BPE merges under which every piece in `pieces` encodes to one token.

    Merges are added along each piece's current tokenization and appended (lowest priority), then
    every piece is checked again, since a merge added for one word can split another; a few rounds
    reach a fixed point.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    merges: list[tuple[str, str]] = []
    for _ in range(16):
        vocab = {tok: i for i, tok in enumerate(dict.fromkeys(alphabet + ["".join(m) for m in merges]))}
        model = Tokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
        added = False
        for piece in pieces:
            parts = [t.value for t in model.model.tokenize(piece)]
            while len(parts) > 1:
                pair = (parts[0], parts[1])
                if pair not in merges:
                    merges.append(pair)
                    added = True
                parts = [parts[0] + parts[1], *parts[2:]]
        if not added:
            return merges
    raise RuntimeError("tiny Qwen tokenizer: merges did not converge")


def build_tokenizer() -> Any:
    """An offline Qwen2Tokenizer: byte-level BPE with one token per template piece and every byte."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    special = re.compile("|".join(re.escape(t) for t in _SPECIAL_TOKENS))
    pieces = [
        piece
        for text in _templates()
        for chunk in special.split(text)
        for piece, _ in split.pre_tokenize_str(chunk)
        if len(piece) > 1
    ]
    merges = _merges_for(list(dict.fromkeys(pieces)), alphabet)
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(alphabet + ["".join(m) for m in merges]))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_SPECIAL_TOKENS[1:])})
    return tokenizer


# -- components -----------------------------------------------------------------------------------------


def build_processor(tokenizer: Any) -> Any:
    """The Qwen2VL processor over `tokenizer`: PIL image processor, fixed 4x4 patch grid, no video processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffuserve.models.processor_substitutes import install_processor_substitutes

    install_processor_substitutes()
    import transformers

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=VISION_PIXELS, max_pixels=VISION_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    return transformers.Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _text_encoder(tokenizer: Any, seed: int) -> Any:
    """A 2-layer Qwen2.5-VL (text and vision) over `tokenizer`'s vocabulary."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = 16
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": TEXT_HIDDEN // head_dim,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "out_hidden_size": TEXT_HIDDEN,
            "fullatt_block_indexes": [1],
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _transformer(seed: int) -> Any:
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    # head dim 16 splits into RoPE axes (frame, row, column) = (4, 6, 6), as 128 into (16, 56, 56) upstream.
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=Z_DIM * 4,
        out_channels=Z_DIM,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_HIDDEN,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    # With the default init the output tokens barely see the context (near-uniform attention over ~1000
    # image-latent tokens, small gates): the prompt and the input image would move the output pixels by
    # < 1/255, and a test comparing against diffusers could not tell a wrong prompt or image. Larger
    # block weights and q/k norm gains make both move the output by tens of levels.
    with torch.no_grad():
        for name, param in model.transformer_blocks.named_parameters():
            if param.dim() == 2:
                param.mul_(3.0)
            elif name.rsplit(".", 2)[-2] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                param.fill_(4.0)
    return model


def _vae(seed: int) -> Any:
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    # Five levels (16x) without encoder residual blocks: see the module docstring for why.
    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=0,
        temperal_downsample=[False, True, True, False],
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    ).eval()


def build_components(seed: int = 0) -> dict[str, Any]:
    """The six components of a tiny Qwen-Image-Edit pipeline (shared by Edit and EditPlus)."""
    tokenizer = build_tokenizer()
    return {
        "scheduler": qwen_image_scheduler(),
        "vae": _vae(seed + 3),
        "text_encoder": _text_encoder(tokenizer, seed + 1),
        "tokenizer": tokenizer,
        "processor": build_processor(build_tokenizer()),
        "transformer": _transformer(seed + 2),
    }


def _save(pipeline_class_name: str, output_dir: Path) -> None:
    import diffusers

    from diffuserve.models import tiny

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    pipe = getattr(diffusers, pipeline_class_name)(**build_components())
    pipe.save_pretrained(output_dir, safe_serialization=True)
    tiny.write_defaults(output_dir, TINY_DEFAULTS)


def build_edit(output_dir: Path) -> None:
    """`make-tiny --family qwen-image-edit`: a tiny `QwenImageEditPipeline` folder (one input image)."""
    _save("QwenImageEditPipeline", output_dir)


def build_edit_plus(output_dir: Path) -> None:
    """`make-tiny --family qwen-image-edit-plus`: a tiny `QwenImageEditPlusPipeline` folder (2509/2511 layout)."""
    _save("QwenImageEditPlusPipeline", output_dir)
