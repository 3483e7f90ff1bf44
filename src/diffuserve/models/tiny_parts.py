"""The pieces several tiny checkpoint builders share (`models/tiny.py`, `families/*/tiny.py`): small offline
vocabularies, tiny encoder configs and the Qwen-Image scheduler. Moved here unchanged from the builders that first
had them, so every tiny checkpoint keeps its bytes; a builder imports these public names, never another builder's
private ones. As in the builders, torch / diffusers / transformers / tokenizers are imported inside functions.
"""

from __future__ import annotations

from typing import Any

# -- vocabularies ---------------------------------------------------------------------------------------

BIGRAMS = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve co me "
    "de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns ge ly ei os no pe do su pa ec ac"
).split()
_T5_WORDS = (
    "a an the of and in on with at to for by from cat dog bird fish tree house city sky sea sun moon "
    "red blue green yellow black white small big old new photo painting portrait landscape of surfing "
    "wave mountain river forest night day light dark style detailed high quality art"
).split()


def t5_pieces() -> list[tuple[str, float]]:
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = [chr(c) for c in range(33, 127)]
    pieces += [("▁" + w, -4.0 - 0.01 * i) for i, w in enumerate(dict.fromkeys(_T5_WORDS))]
    pieces += [("▁" + c, -8.0) for c in chars]
    pieces += [(c, -9.0) for c in chars]
    return pieces


def sentencepiece_vocab(specials: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small SentencePiece-style BPE vocabulary (byte fallback, `▁` word starts, some bigram merges) for the
    Llama and Gemma tokenizers: every string encodes, and different prompts give different ids."""
    tokens = list(specials) + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]
    merges: list[tuple[str, str]] = []
    for pair in BIGRAMS:
        merges.append((pair[0], pair[1]))
        tokens.append(pair)
    for letter in "abcdefghijklmnopqrstuvwxyz":
        merges.append(("▁", letter))
        tokens.append("▁" + letter)
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}, merges


# Words of FLUX.2's SYSTEM_MESSAGE and a few prompt words: each gets a chain of merges, so it is one token.
_BPE_WORDS = (
    "You are an AI that reasons about image descriptions give structured responses focusing on object "
    "relationships attribution and actions without speculation a the of in with cat dog red blue green "
    "photo painting small big user assistant"
).split()
_BPE_BIGRAMS = "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve".split()


def byte_bpe_vocab(specials: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE: specials, the 256 byte symbols, whole-word and bigram merges."""
    from tokenizers import pre_tokenizers

    tokens: list[str] = [*specials, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if a + b not in tokens:
            merges.append((a, b))
            tokens.append(a + b)

    # Merge rank is priority: whole words after a space first (they only grow from the "Ġ" at a word's
    # start, so they cannot cut into each other), then words at the start of a text, then bigrams.
    words = list(dict.fromkeys(_BPE_WORDS))
    for piece_start, drop in (("Ġ", 0), ("", 1)):
        for word in words:
            piece = piece_start or word[0]
            for ch in word[drop:]:
                merge(piece, ch)
                piece += ch
    for pair in _BPE_BIGRAMS:
        merge(pair[0], pair[1])
    return {tok: i for i, tok in enumerate(tokens)}, merges


# -- encoder configs and schedulers ---------------------------------------------------------------------


def tiny_clip_config(tokenizer: Any, hidden: int) -> dict[str, Any]:
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


def tiny_t5_config(tokenizer: Any, hidden: int) -> dict[str, Any]:
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


def qwen_image_scheduler() -> Any:
    """The published Qwen-Image scheduler settings (exponential dynamic shift, terminal shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    # The published Qwen-Image scheduler settings (exponential dynamic shift, terminal shift).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
