"""A tiny SANA checkpoint (the `SanaPipeline` layout of SANA 600M / 1600M / 1.5), built offline.

Same components and configs as the published checkpoints, shrunk: a Gemma2 text encoder over a small
Gemma-style BPE vocabulary (byte fallback, "▁" word starts), a 2-layer linear-attention DiT with
SANA 1.5's q/k norms, a 32x deep-compression autoencoder (DC-AE f32, six stages like the real one),
and the flow DPM-Solver scheduler the conversion script writes. Fixed seeds per component, so every
build writes the same bytes.

The transformer's `sample_size` is 16 latent pixels (512 px): SanaPipeline's default resolution
binning picks its aspect-ratio table from that value (16 -> the 512 px table), so a tiny checkpoint
runs with the same default call as the real 1024 px models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_SANA_DEFAULTS = {"width": 64, "height": 64, "num_inference_steps": 4}
"""What the tiny checkpoint suggests as request defaults (generated at the 512 px bin, resized to 64)."""

# Whole words of the complex human instruction and of common prompts, so the ~1000-character
# instruction the pipeline prepends is ~250 tokens instead of one per character.
_WORDS = (
    "a an the of and in on with at to for by from or is are be that this it as if its any only how "
    "user prompt prompts enhanced generate generation given image visual description descriptions "
    "detail details detailed level simple already refine enhance existing slightly without adding "
    "specifics about colors shapes sizes textures spatial relationships create vivid concrete scenes "
    "scene here examples transform please below avoid including additional commentary evaluations "
    "provides suitable evaluate focus overcomplicating cat dog sleeping small fluffy white curled up "
    "round shape peacefully warm sunny windowsill surrounded pots blooming red flowers busy city street "
    "bustling dusk featuring glowing lamps diverse crowd people colorful clothing double decker bus "
    "passing towering glass skyscrapers blue green yellow black photo painting portrait landscape sky "
    "sea sun moon tree house bird fish mountain river forest night day light dark style art"
).split()


def build_gemma_tokenizer() -> Any:
    """An offline GemmaTokenizer: Gemma's special ids, byte fallback, letters and "▁word" pieces."""
    from transformers import GemmaTokenizer

    # Gemma's own order for the first ids: <pad>=0, <eos>=1, <bos>=2, <unk>=3, <mask>=4.
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁"] + [chr(c) for c in range(33, 127)]
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys(_WORDS):
        piece = "▁" + word[0]
        merges.append(("▁", word[0]))
        tokens.append(piece)
        for ch in word[1:]:
            merges.append((piece, ch))
            piece += ch
            tokens.append(piece)
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    merges = list(dict.fromkeys(merges))
    # SanaPipeline sets padding_side="right" itself before every call; saving it keeps a plain
    # tokenizer call (ours) padding the same way.
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, padding_side="right")


def _components() -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = build_gemma_tokenizer()
    text_hidden = 16
    torch.manual_seed(91)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            query_pre_attn_scalar=8,
            max_position_embeddings=2048,
            sliding_window=4096,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
    ).eval()
    torch.manual_seed(92)
    # inner dim 16 = heads x head dim = cross_attention_dim, as 2240 = 70 x 32 upstream; patch 1 on
    # the 32x latent; no positional embedding (interpolation_scale=None, the 512/1024 px models).
    transformer = SanaTransformer2DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=text_hidden,
        mlp_ratio=2.5,
        attention_bias=False,
        sample_size=16,
        patch_size=1,
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        interpolation_scale=None,
        qk_norm="rms_norm_across_heads",
    ).eval()
    torch.manual_seed(93)
    # DC-AE f32c32 (SANA's), shrunk: six stages (32x), ResBlocks then EfficientViT blocks.
    stages = 6
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=8,
        attention_head_dim=8,
        encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        encoder_block_out_channels=(4, 8, 8, 16, 16, 16),
        decoder_block_out_channels=(4, 8, 8, 16, 16, 16),
        encoder_layers_per_block=(1,) * stages,
        decoder_layers_per_block=(1,) * stages,
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3,
        decoder_act_fns=("relu",) * 3 + ("silu",) * 3,
        scaling_factor=0.41407,
    ).eval()
    # What diffusers' convert_sana_to_diffusers writes for the 512/1024/2K models (4K: shift 6).
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "transformer": transformer,
        "scheduler": scheduler,
    }


def build(output_dir: Path) -> None:
    """Write the tiny SANA checkpoint (diffusers layout, safetensors) into `output_dir`."""
    from diffusers import SanaPipeline

    from diffuserve.models import tiny

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    SanaPipeline(**_components()).save_pretrained(output_dir, safe_serialization=True)
    tiny.write_defaults(output_dir, TINY_SANA_DEFAULTS)
