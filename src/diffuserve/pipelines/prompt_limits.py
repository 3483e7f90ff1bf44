"""How many tokens a prompt takes in each text encoder, so a too-long prompt is reported, not silently cut.

Family-agnostic: a pipeline lists its text encoders as `TextEncoderLimit`s (tokenizer + the most
tokens the encoder is given, special tokens included) from `prompt_token_limits()`; the server calls
`check_texts` before queueing a request and warns (or, with `--reject-truncated-prompts`, refuses).
"""

from __future__ import annotations

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


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of `text` as the encoder would see it untruncated (special tokens included)."""
    # verbose=False: transformers otherwise logs "sequence length is longer than the maximum" itself.
    return len(tokenizer(text, truncation=False, add_special_tokens=True, verbose=False)["input_ids"])


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
