"""Build tiny diffusers-format checkpoints offline (the test models), and install the embedded default.

The embedded default is the trained demo checkpoint shipped as package data (`DEMO_CHECKPOINT`);
the random-weight checkpoints are the test and benchmark models. `build_tiny_checkpoint` (`make-tiny`) runs the
builder a family spec names (`tiny_builds`, in `families/<family>/tiny.py`); this module holds what they share
(offline tokenizers, encoder configs, the suggested-defaults writer).

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


def write_defaults(output_dir: Path, defaults: dict[str, Any]) -> None:
    """Add `DEFAULTS_KEY` to model_index.json, keeping diffusers' own formatting (stable bytes)."""
    index_file = output_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index[DEFAULTS_KEY] = defaults
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def tiny_families() -> list[str]:
    """Every `make-tiny --family` name, from the family specs."""
    from diffuserve import family_spec

    return sorted(family_spec.tiny_builds())


def build_tiny_checkpoint(family: str, output_dir: Path, *, preset: str = "tiny") -> Path:
    """Write the tiny checkpoint `family` (a `make-tiny --family` name) into `output_dir`; returns it.

    Same bytes on every build; the diffusers layout, loadable with `local_files_only=True`. `preset` is
    `tiny` or, for `flux` only, `36m` (a ~36M-parameter transformer for benchmarks); the 72k `tiny` FLUX is the test
    model.
    """
    import importlib
    import inspect

    from diffuserve import family_spec

    builds = family_spec.tiny_builds()
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
        # Inside the try too: an existing models/ folder the user cannot write (a cache volume made by root).
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    except OSError as exc:
        raise ConfigError(
            f"cannot create the model cache {target.parent} ({exc}); set DIFFUSERVE_CACHE to a writable folder "
            "or pass --model-path."
        ) from exc
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
