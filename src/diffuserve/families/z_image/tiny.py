"""A tiny Z-Image checkpoint (the `ZImagePipeline` layout of Z-Image and Z-Image-Turbo), built offline.

Same components and configs as the published checkpoints, shrunk: a Qwen3 text encoder over a small
byte-level BPE vocabulary with the Qwen chat template (the pipeline wraps every prompt in it), a
2-layer single-stream DiT with the real RoPE layout, a FLUX-style 16-channel AutoencoderKL, and
Z-Image-Turbo's scheduler config. Fixed seeds per component, so every build writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_Z_IMAGE_DEFAULTS = {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 0.0}
"""What the tiny checkpoint suggests as request defaults: small, and Z-Image-Turbo's guidance 0 (the family
spec's default) so that the diffusers backend, which otherwise takes ZImagePipeline's call default of 5.0,
samples the same way as the native adapter."""

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
"""Qwen3's special tokens that the chat template and padding use."""

# The prompt layout of Qwen3's chat template for one user turn plus the generation prompt, which is
# all ZImagePipeline renders: with `enable_thinking=True` (what the pipeline passes) no think block
# is added; with False an empty one is, as in the real template.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

TINY_TEXT_LENGTH = 512
"""Token limit the tokenizer declares (ZImagePipeline's `max_sequence_length` default)."""


def build_qwen_tokenizer() -> Any:
    """An offline Qwen2Tokenizer: byte-level alphabet, the shared bigram merges, Qwen's specials."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    from diffuserve.models.tiny_parts import BIGRAMS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(alphabet)
    merges: list[tuple[str, str]] = []
    # "Ġ" is the byte-level form of a leading space: word starts merge first, then common bigrams,
    # so different prompts give different (and fewer) ids as with the real 151k vocabulary.
    for letter in "abcdefghijklmnopqrstuvwxyz":
        merges.append(("Ġ", letter))
        tokens.append("Ġ" + letter)
    for pair in BIGRAMS:
        merges.append((pair[0], pair[1]))
        tokens.append(pair)
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    for special in QWEN_SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=TINY_TEXT_LENGTH,
        padding_side="right",
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def _components() -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = build_qwen_tokenizer()
    text_hidden = 16
    torch.manual_seed(81)
    # Two layers: the pipeline reads hidden_states[-2] (the second-to-last layer's output), so a
    # layer-wise offload of the encoder has more than one block to stream.
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=TINY_TEXT_LENGTH,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    ).eval()
    torch.manual_seed(82)
    # head dim 16 = sum(axes_dims) as 128 = 32 + 48 + 48 upstream. axes_lens: the caption axis must
    # hold max_sequence_length (512) padded to 32 plus the image frame index; the image axes allow
    # 32 patches per side, i.e. 512 px with the VAE's 8x and the 2x2 patches.
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=text_hidden,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 4, 4],
        axes_lens=[1024, 32, 32],
    ).eval()
    # The pad tokens are created with torch.empty (undefined bytes); give them seeded values so
    # builds are identical and padded positions carry finite numbers.
    with torch.no_grad():
        transformer.x_pad_token.normal_(0.0, 0.02)
        transformer.cap_pad_token.normal_(0.0, 0.02)
    torch.manual_seed(83)
    # The FLUX.1 VAE layout the published checkpoints ship (16 latent channels, 8x), shrunk.
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    # Z-Image-Turbo's scheduler/scheduler_config.json: static shift 3, no resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def build(output_dir: Path) -> None:
    """Write the tiny Z-Image checkpoint (diffusers layout, safetensors) into `output_dir`."""
    from diffusers import ZImagePipeline

    from diffuserve.models import tiny

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    ZImagePipeline(**_components()).save_pretrained(output_dir, safe_serialization=True)
    tiny.write_defaults(output_dir, TINY_Z_IMAGE_DEFAULTS)
