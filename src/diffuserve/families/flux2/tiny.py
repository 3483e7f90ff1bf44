"""Tiny FLUX.2 checkpoints, built offline: FLUX.2-dev (`Flux2Pipeline`) and FLUX.2-Klein (`Flux2KleinPipeline`).

Random weights, real configs shrunk, fixed seeds per component, so every build writes the same bytes and the
folders load with `Flux2Pipeline.from_pretrained(dir, local_files_only=True)` (resp. Klein) like a real one.

Choices that keep the shapes honest:
- The text encoders keep enough layers for the pipelines' default hidden-state taps: FLUX.2-dev stacks
  Mistral3 layers (10, 20, 30), Klein stacks Qwen3 layers (9, 18, 27), so the tiny encoders have 30 and 27
  layers (a few thousand parameters each); the transformer's `joint_attention_dim` is 3 x the text width.
- Both tokenizers are byte-level BPE (any prompt encodes, no `<unk>`) with whole-word merges for the words of
  FLUX.2's system message, so the chat-formatted prompt stays short. They declare `model_max_length` (see
  `TEXT_LENGTH`) and the native adapter caps diffusers' default 512 by it, as for tiny FLUX.1.
- FLUX.2-dev's real `tokenizer` is a `PixtralProcessor`, which cannot be built without torchvision (absent on
  CPU machines here). The pipeline's text path only calls `apply_chat_template` on text, which a tokenizer
  does the same way, so the tiny checkpoint ships the tokenizer itself (`TokenizersBackend`) with the chat
  template; the native adapter accepts either.
- The VAE is `AutoencoderKLFlux2` (2x2 patchified latents, batch-norm statistics) with non-trivial running
  statistics, so the latent normalisation is exercised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffuserve.models.tiny_parts import byte_bpe_vocab

TEXT_LENGTH = 64
"""Text tokens per prompt the tiny checkpoints declare (`model_max_length`); real FLUX.2 uses 512. The chat-
formatted FLUX.2-dev prompt (system message included) is ~40 tokens before the user's text."""

TINY_DEFAULTS = {"width": 64, "height": 64, "num_inference_steps": 4}
"""Request defaults the tiny checkpoints suggest (written into model_index.json)."""

LATENT_CHANNELS = 4
"""VAE latent channels of the tiny checkpoints (real FLUX.2: 32); the transformer sees 4x this after 2x2 patching."""

TEXT_HIDDEN = 16
"""Hidden width of the tiny text encoders (the transformer sees 3 stacked layers: 48)."""


_MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>")
_MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's template, reduced to what FLUX.2-Klein sends (one user turn, generation prompt, thinking off).
_QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_mistral_tokenizer() -> Any:
    """FLUX.2-dev's tokenizer: byte-level BPE, Mistral's special tokens and a Mistral-style chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import TokenizersBackend

    vocab, merges = byte_bpe_vocab(_MISTRAL_SPECIALS)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    # Chat-template markers are special tokens: matched whole in the formatted text, never split.
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _MISTRAL_SPECIALS])
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="right",
        model_max_length=TEXT_LENGTH,
        chat_template=_MISTRAL_CHAT_TEMPLATE,
    )


def build_qwen_tokenizer() -> Any:
    """FLUX.2-Klein's tokenizer: Qwen2Tokenizer over the tiny byte-level BPE, Qwen's chat tokens, Qwen3 template."""
    from transformers import Qwen2Tokenizer

    vocab, merges = byte_bpe_vocab(_QWEN_SPECIALS)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        padding_side="right",
        model_max_length=TEXT_LENGTH,
        chat_template=_QWEN_CHAT_TEMPLATE,
    )
    tok.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIALS[1:])})
    return tok


def _mistral3(vocab_size: int, pad_token_id: int) -> Any:
    """FLUX.2-dev's text encoder: Mistral3 (Pixtral vision tower + Mistral LM), 30 tiny text layers."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": vocab_size,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": 30,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 4 * TEXT_LENGTH,
            "pad_token_id": pad_token_id,
            "tie_word_embeddings": True,
        },
        # The vision tower only serves prompt upsampling (not a serving path); it is as small as it gets.
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
        tie_word_embeddings=True,
    )
    return Mistral3ForConditionalGeneration(config)


def _qwen3(vocab_size: int, pad_token_id: int) -> Any:
    """FLUX.2-Klein's text encoder: Qwen3ForCausalLM with 27 tiny layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=TEXT_HIDDEN,
            intermediate_size=32,
            num_hidden_layers=27,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=4 * TEXT_LENGTH,
            pad_token_id=pad_token_id,
            tie_word_embeddings=True,
        )
    )


def _transformer(*, guidance_embeds: bool) -> Any:
    """A tiny Flux2Transformer2DModel: 1 double + 1 single block, 2 heads of 16 (RoPE axes 4 x 4)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_HIDDEN,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def build_vae() -> Any:
    """A tiny AutoencoderKLFlux2 (scale factor 8) with fixed, non-trivial batch-norm statistics."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=TINY_DEFAULTS["width"],
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # Real checkpoints carry measured latent statistics; random ones keep the (x - mean) / std path honest.
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, channels))
    return vae


def _scheduler() -> Any:
    # FLUX.2's published scheduler config; the pipelines pass `mu` from compute_empirical_mu.
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def _save(pipe: Any, output_dir: Path) -> None:
    from diffuserve.models.tiny import write_defaults

    output_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, TINY_DEFAULTS)


def build_flux2(output_dir: Path) -> None:
    """Write a tiny FLUX.2-dev checkpoint (`Flux2Pipeline`: Mistral3 encoder, embedded guidance)."""
    import torch
    from diffusers import Flux2Pipeline

    tokenizer = build_mistral_tokenizer()
    torch.manual_seed(801)
    text_encoder = _mistral3(len(tokenizer), tokenizer.pad_token_id).eval()
    torch.manual_seed(802)
    transformer = _transformer(guidance_embeds=True).eval()
    torch.manual_seed(803)
    vae = build_vae().eval()
    pipe = Flux2Pipeline(
        scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    _save(pipe, Path(output_dir))


def build_flux2_klein(output_dir: Path) -> None:
    """Write a tiny FLUX.2-Klein-Base checkpoint (`Flux2KleinPipeline`: Qwen3 encoder, real CFG, not distilled)."""
    import torch
    from diffusers import Flux2KleinPipeline

    tokenizer = build_qwen_tokenizer()
    torch.manual_seed(811)
    text_encoder = _qwen3(len(tokenizer), tokenizer.pad_token_id).eval()
    torch.manual_seed(812)
    transformer = _transformer(guidance_embeds=False).eval()
    torch.manual_seed(813)
    vae = build_vae().eval()
    pipe = Flux2KleinPipeline(
        scheduler=_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )
    _save(pipe, Path(output_dir))
