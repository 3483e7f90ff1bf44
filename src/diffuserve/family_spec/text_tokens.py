"""A checkpoint's text encoders as the HTTP front end sees them (`EncoderLimit`: which tokenizer folder, how many of
a prompt's tokens each encoder reads) and token ids that say which tokenizer made them (`TokenIds`). Plain data: it
crosses processes; the front end builds its own prompt counter from the folders (`pipelines/prompt_limits.py`,
`PromptTokens.from_table`) and never asks the engine's pipeline to tokenize. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderLimit:
    """One text encoder of the served checkpoint: what the front end loads to count a prompt for it."""

    encoder: str
    """Name shown to users, e.g. `text_encoder_2 (T5)`."""
    key: str | None
    """The tokenizer's model_index key (`tokenizer_2`): counted ids travel to the encode under it; None: they do not."""
    folder: str | None
    """The folder the engine loaded the tokenizer from (None: it was built in memory; the front end cannot count
    for this encoder and counts words for usage instead)."""
    tokenizer_class: str
    """The transformers tokenizer class the engine loaded (`T5TokenizerFast`): the front end loads the same class."""
    max_tokens: int | None
    """Prompt tokens (special tokens included) the encoder reads, net of the pipeline's framing (chat template,
    system message); the rest is cut off. None: the whole prompt."""


@dataclass(frozen=True)
class TokenIds:
    """One tokenizer's ids of a request's texts (untruncated, special tokens included), stamped with which tokenizer
    made them: the encode reuses them only when its own tokenizer has the same stamp, else it tokenizes again."""

    tokenizer: str
    """The stamp of the tokenizer that made the ids (`pipelines/token_ids.fingerprint`)."""
    ids: Mapping[str, tuple[int, ...]]
    """Text -> its ids."""
