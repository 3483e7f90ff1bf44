"""Build tiny diffusers-format checkpoints offline (the test models), and install the embedded default.

The embedded default is the trained demo checkpoint shipped as package data (`DEMO_CHECKPOINT`);
the random-weight checkpoints built here are the test and benchmark models.

Everything is built from in-code configs and vocabularies with fixed seeds, so two builds write the
same bytes and no step touches the network. The layout is exactly what `diffusers` saves, so the
checkpoint loads through the normal loader (and through `FluxPipeline.from_pretrained`) like a
user's checkpoint would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError
from diffuserve.models.registry import DEFAULTS_KEY
from diffuserve.paths import default_cache_dir

DEFAULT_MODEL_NAME = "flux-demo-shapes-v3"
"""Folder name of the embedded default model under `$DIFFUSERVE_CACHE/models/` (bump on any change)."""

DEMO_CHECKPOINT = Path(__file__).parent / "demo_flux"
"""The embedded default model as shipped (package data): the trained demo checkpoint that draws one
coloured shape on white ("a red circle in the top left"), written by `python -m diffuserve.demo.train`."""

WAN_TINY_DEFAULTS = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4, "fps": 8}
"""What the tiny Wan2.1 checkpoint suggests: small enough that a video job takes well under a second."""


@dataclass(frozen=True)
class TinyFluxPreset:
    """Sizes of a tiny FLUX.1-style checkpoint. Encoders and VAE stay tiny in every preset."""

    num_layers: int = 1
    """Double-stream (MM-DiT) blocks of the transformer."""
    num_single_layers: int = 1
    """Single-stream blocks of the transformer."""
    num_attention_heads: int = 2
    """Attention heads of the transformer."""
    attention_head_dim: int = 16
    """Per-head width; must equal sum(axes_dims_rope)."""
    axes_dims_rope: tuple[int, int, int] = (4, 4, 8)
    """RoPE dims per position axis (text index, row, column)."""
    guidance_embeds: bool = True
    """FLUX.1-dev style embedded guidance (False = schnell style)."""
    text_hidden: int = 32
    """Hidden width of both text encoders (= joint_attention_dim and pooled_projection_dim)."""
    latent_channels: int = 4
    """VAE latent channels; the transformer sees 4x this after 2x2 packing."""
    vae_channels: tuple[int, ...] = (8, 8, 8, 8)
    """VAE block widths; four levels give a scale factor of 8, so sizes are multiples of 16."""
    sample_size: int = 64
    """Default image size in pixels (VAE `sample_size`, which our pipeline uses as its default)."""
    seed: int = 0
    """Seed of the random weights."""


PRESETS: dict[str, TinyFluxPreset] = {
    # ~72k-parameter transformer: overhead-bound, the test model.
    "tiny": TinyFluxPreset(),
    # ~36M-parameter transformer: saturates 2 CPU cores, for benchmarks where batching cannot pay.
    "36m": TinyFluxPreset(
        num_layers=2,
        num_single_layers=4,
        num_attention_heads=8,
        attention_head_dim=64,
        axes_dims_rope=(16, 24, 24),
    ),
}


# -- tokenizers ---------------------------------------------------------------------------------------
# Small but real vocabularies: byte-level BPE for CLIP (every byte is covered, so any prompt encodes
# without <unk>) and unigram pieces for T5 (letters, digits, punctuation and some whole words), so
# different prompts give different token ids as with the real tokenizers.

_BIGRAMS = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve co me "
    "de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns ge ly ei os no pe do su pa ec ac"
).split()
_T5_WORDS = (
    "a an the of and in on with at to for by from cat dog bird fish tree house city sky sea sun moon "
    "red blue green yellow black white small big old new photo painting portrait landscape of surfing "
    "wave mountain river forest night day light dark style detailed high quality art"
).split()


def _clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(alphabet) + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for pair in _BIGRAMS:
        a, b = pair[0], pair[1]
        merges.append((a, b))
        merges.append((a, b + "</w>"))
        tokens += [a + b, a + b + "</w>"]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    return vocab, merges


def _t5_pieces() -> list[tuple[str, float]]:
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = [chr(c) for c in range(33, 127)]
    pieces += [("▁" + w, -4.0 - 0.01 * i) for i, w in enumerate(dict.fromkeys(_T5_WORDS))]
    pieces += [("▁" + c, -8.0) for c in chars]
    pieces += [(c, -9.0) for c in chars]
    return pieces


TINY_FLUX_T5_LENGTH = 64
"""T5 tokens per prompt the tiny FLUX checkpoints declare (tokenizer_2 `model_max_length`).

Real FLUX.1 declares 512. A tiny model with 512 text tokens beside 16 image tokens spends nearly all
its time on the text stream, which is not the overhead-bound regime a tiny serving model stands for;
64 tokens still hold every prompt the tests use."""


def build_tokenizers(t5_max_length: int = 512) -> tuple[Any, Any]:
    """The offline (CLIPTokenizer, T5Tokenizer) pair every tiny checkpoint ships."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab, merges = _clip_vocab_and_merges()
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    t5 = T5Tokenizer(vocab=_t5_pieces(), extra_ids=100, model_max_length=t5_max_length)
    return clip, t5


# -- models -------------------------------------------------------------------------------------------


def _tiny_clip_config(tokenizer: Any, hidden: int) -> dict[str, Any]:
    """A 2-layer CLIP text config over `tokenizer`'s vocabulary (FLUX's CLIP encoder)."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 37,
        "projection_dim": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 77,
        "hidden_act": "gelu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _tiny_t5_config(tokenizer: Any, hidden: int) -> dict[str, Any]:
    """A 2-layer T5/UMT5 encoder config over `tokenizer`'s vocabulary (FLUX's text_encoder_2, Wan's encoder)."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": hidden,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
        "decoder_start_token_id": 0,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _build_flux_components(preset: TinyFluxPreset) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if sum(preset.axes_dims_rope) != preset.attention_head_dim:
        raise ConfigError(
            f"tiny preset: sum(axes_dims_rope)={sum(preset.axes_dims_rope)} must equal "
            f"attention_head_dim={preset.attention_head_dim}."
        )
    clip_tok, t5_tok = build_tokenizers(TINY_FLUX_T5_LENGTH)
    h = preset.text_hidden

    # Each model gets its own fixed seed so that changing one component leaves the others' bytes alone.
    torch.manual_seed(preset.seed + 1)
    clip = CLIPTextModel(CLIPTextConfig(**_tiny_clip_config(clip_tok, h)))
    torch.manual_seed(preset.seed + 2)
    t5 = T5EncoderModel(T5Config(**_tiny_t5_config(t5_tok, h)))
    torch.manual_seed(preset.seed + 3)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=preset.latent_channels * 4,
        num_layers=preset.num_layers,
        num_single_layers=preset.num_single_layers,
        attention_head_dim=preset.attention_head_dim,
        num_attention_heads=preset.num_attention_heads,
        joint_attention_dim=h,
        pooled_projection_dim=h,
        guidance_embeds=preset.guidance_embeds,
        axes_dims_rope=preset.axes_dims_rope,
    )
    torch.manual_seed(preset.seed + 4)
    levels = len(preset.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=preset.vae_channels,
        layers_per_block=1,
        latent_channels=preset.latent_channels,
        norm_num_groups=4,
        sample_size=preset.sample_size,
        scaling_factor=1.5035,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # The shift settings of FLUX.1-dev; they make `mu` depend on the image token count as upstream.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return {
        "scheduler": scheduler,
        "vae": vae.eval(),
        "text_encoder": clip.eval(),
        "tokenizer": clip_tok,
        "text_encoder_2": t5.eval(),
        "tokenizer_2": t5_tok,
        "transformer": transformer.eval(),
    }


def _build_wan_components(preset: TinyFluxPreset) -> dict[str, Any]:
    """A tiny Wan2.1 text-to-video layout (UMT5 encoder, 3D transformer, causal video VAE, UniPC).

    The shapes follow the real Wan2.1 T2V checkpoint scaled down: patch (1, 2, 2) over a VAE with
    8x spatial and 4x temporal compression, so sizes are multiples of 16 and frame counts are 4k+1.
    """
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    _, t5_tok = build_tokenizers()
    h = preset.text_hidden
    z_dim = preset.latent_channels
    torch.manual_seed(preset.seed + 21)
    text_encoder = UMT5EncoderModel(UMT5Config(**_tiny_t5_config(t5_tok, h))).eval()
    torch.manual_seed(preset.seed + 22)
    # head dim 12 splits into RoPE axes (t, h, w) = (4, 4, 4), as 128 splits into (44, 42, 42) upstream.
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=z_dim,
        out_channels=z_dim,
        text_dim=h,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    torch.manual_seed(preset.seed + 23)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    ).eval()
    # The scheduler of the published Wan2.1 T2V checkpoints: UniPC over flow-matching sigmas.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    return {
        "tokenizer": t5_tok,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": scheduler,
        "transformer": transformer,
    }


def write_defaults(output_dir: Path, defaults: dict[str, Any]) -> None:
    """Add `DEFAULTS_KEY` to model_index.json, keeping diffusers' own formatting (stable bytes)."""
    index_file = output_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index[DEFAULTS_KEY] = defaults
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def build_flux(output_dir: Path, preset: str = "tiny") -> None:
    """The tiny FLUX.1-style checkpoint (`preset` tiny: the embedded default; 36m: for benchmarks)."""
    from diffusers import FluxPipeline

    FluxPipeline(**_build_flux_components(PRESETS[preset])).save_pretrained(output_dir, safe_serialization=True)


def build_wan(output_dir: Path) -> None:
    """A tiny Wan2.1 text-to-video checkpoint that suggests its own small defaults."""
    from diffusers import WanPipeline

    WanPipeline(**_build_wan_components(PRESETS["tiny"])).save_pretrained(output_dir, safe_serialization=True)
    write_defaults(output_dir, WAN_TINY_DEFAULTS)


def tiny_families() -> list[str]:
    """Every `make-tiny --family` name, from the family specs."""
    from diffuserve import families

    return sorted(families.tiny_builds())


def build_tiny_checkpoint(family: str, output_dir: Path, *, preset: str = "tiny") -> Path:
    """Write the tiny checkpoint `family` (a `make-tiny --family` name) into `output_dir`; returns it.

    Same bytes on every build; the diffusers layout, loadable with `local_files_only=True`. `preset` is
    `tiny` or, for `flux` only, `36m` (a ~36M-parameter transformer for benchmarks); the 72k `tiny` FLUX is the test model.
    """
    import importlib
    import inspect

    from diffuserve import families

    builds = families.tiny_builds()
    if family not in builds:
        raise ConfigError(
            f"--family {family!r} cannot be built as a tiny checkpoint; choose one of {sorted(builds)}.",
            param="family",
        )
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is unknown; choose one of {sorted(PRESETS)}.", param="preset")
    module_name, _, function_name = builds[family].partition(":")
    build = getattr(importlib.import_module(module_name), function_name)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if "preset" in inspect.signature(build).parameters:
        build(output_dir, preset=preset)
    elif preset != "tiny":
        raise ConfigError(f"--preset {preset!r}: family {family!r} has only the `tiny` preset.", param="preset")
    else:
        build(output_dir)
    return output_dir


def install_demo_checkpoint(output_dir: Path) -> Path:
    """Copy the shipped demo checkpoint (`DEMO_CHECKPOINT`) into `output_dir`; returns it."""
    if not (DEMO_CHECKPOINT / "model_index.json").is_file():
        raise ConfigError(
            f"the embedded demo checkpoint is missing from the installed package ({DEMO_CHECKPOINT}); "
            "reinstall diffuserve, or pass --model-path."
        )
    shutil.copytree(DEMO_CHECKPOINT, output_dir, dirs_exist_ok=True)
    return Path(output_dir)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Install the embedded default model once into `<cache>/models/<DEFAULT_MODEL_NAME>`; returns its path.

    The files are copied from the package (`DEMO_CHECKPOINT`) into a temporary folder beside the
    target and renamed into place, so a reader never sees a half-written checkpoint and two racing
    processes both end up with a complete one. The cached copy is then loaded by the normal loader.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / DEFAULT_MODEL_NAME
    if (target / "model_index.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the model cache {target.parent} ({exc}); set DIFFUSERVE_CACHE to a writable folder "
            "or pass --model-path."
        ) from exc
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        install_demo_checkpoint(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (the target now exists and is complete): use theirs.
            if not (target / "model_index.json").is_file():
                raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return target
