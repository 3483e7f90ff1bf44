"""How many tokens a prompt takes in each text encoder, so a too-long prompt is reported, not silently cut.

Family-agnostic: a pipeline lists its text encoders as `TextEncoderLimit`s (tokenizer + the most
tokens the encoder is given, special tokens included) from `prompt_token_limits()`; the server calls
`check_texts` before queueing a request and warns (or, with `--reject-truncated-prompts`, refuses).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TextEncoderLimit:
    """One text encoder's input limit."""

    encoder: str
    """Name shown to users, e.g. `text_encoder_2 (T5)`."""
    tokenizer: Any
    """The encoder's tokenizer (a transformers tokenizer: callable, returns `input_ids`)."""
    max_tokens: int
    """Tokens the pipeline feeds the encoder, special tokens included; the rest is cut off."""


@dataclass(frozen=True)
class PromptTruncation:
    """A text longer than one encoder takes."""

    field: str
    """Request field: `prompt` or `negative_prompt`."""
    encoder: str
    tokens: int
    """Tokens the text has for this encoder (special tokens included)."""
    max_tokens: int

    @property
    def message(self) -> str:
        return (f"{self.field} is {self.tokens} tokens for {self.encoder}, which takes {self.max_tokens}; "
                f"the last {self.tokens - self.max_tokens} tokens are cut off")


_COPIES: dict[int, tuple[Any, Any]] = {}
"""id(tokenizer) -> (the tokenizer, the private copy counts run on)."""
_COPIES_LOCK = threading.Lock()


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of `text` as the encoder would see it untruncated (special tokens included).

    Counted on a private copy of the tokenizer, one count at a time: a fast (Rust) tokenizer keeps its padding /
    truncation settings on the object for the length of a call, so counting on the pipeline's own tokenizer from
    an HTTP thread while the encode lane tokenizes a batch changed what the encode got (an unpadded 27-token T5
    row in a batch of 64-token rows)."""
    with _COPIES_LOCK:
        entry = _COPIES.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            entry = _COPIES[id(tokenizer)] = (tokenizer, copy.deepcopy(tokenizer))
        # verbose=False: transformers otherwise logs "sequence length is longer than the maximum" itself.
        return len(entry[1](text, truncation=False, add_special_tokens=True, verbose=False)["input_ids"])


def check_texts(limits: Sequence[TextEncoderLimit], texts: Mapping[str, str | None]) -> list[PromptTruncation]:
    """Every (field, encoder) pair whose text is longer than the encoder takes; empty when all fit."""
    found: list[PromptTruncation] = []
    for field, text in texts.items():
        if not text:
            continue
        for limit in limits:
            tokens = count_tokens(limit.tokenizer, text)
            if tokens > limit.max_tokens:
                found.append(PromptTruncation(field, limit.encoder, tokens, limit.max_tokens))
    return found
