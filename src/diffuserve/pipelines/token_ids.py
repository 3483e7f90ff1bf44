"""Tokenize once: the encode reuses the token ids the front end's prompt count made.

A served request's texts are tokenized once per tokenizer, by the front end's prompt counter
(`pipelines/prompt_limits.PromptTokens`, built from the checkpoint's tokenizer folders, off the event loop): that
count's ids (untruncated, special tokens included) serve the prompt limits, the truncation warnings and the usage,
and they travel with the request (`SamplingParams.text_ids`: tokenizer key -> `TokenIds`) to the encode. Each
`TokenIds` is stamped with the `fingerprint` of the tokenizer that made it; the encode uses carried ids only when its
own tokenizer has the same fingerprint (a front end that loaded another tokenizer, or none, costs one tokenization,
never a wrong input). A family whose encoder takes a fixed-length, right-padded input (FLUX.1's CLIP and T5) builds
that input from the carried ids with `padded_ids` instead of tokenizing again; only texts that came without ids (the
empty negative text has fixed ids; a request no route counted, a warm-up) are tokenized in the encode.

The padded input is built by a rule (keep the leading ids, then the trailing special tokens, then pad) that is
checked once per (tokenizer, length) against the tokenizer itself on probe texts, a short one, an empty one and
one longer than the length; a tokenizer whose own output differs (another truncation side, pairs, a template) gets
no rule and its encode tokenizes as before, so an input built here is always the one the tokenizer would make.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffuserve.family_spec.text_tokens import TokenIds
from diffuserve.pipelines.prompt_limits import fingerprint

_PROBES = ("a photo of a cat", "")
"""Texts the rule is checked on, with one longer than the length (made per length)."""


@dataclass(frozen=True)
class _PadRule:
    """How a tokenizer truncates and pads one text to a fixed length, from its untruncated ids."""

    length: int
    """The fixed input length (`max_length`)."""
    suffix: int
    """Special tokens after the text's own (kept when the text is cut: `</s>`, `<|endoftext|>`)."""
    pad_id: int
    """The padding id (right padding)."""
    empty: tuple[int, ...]
    """The untruncated ids of the empty text (what an unset negative prompt becomes)."""

    def apply(self, ids: Sequence[int]) -> list[int]:
        if len(ids) > self.length:
            cut = self.length - self.suffix
            ids = list(ids[:cut]) + (list(ids[len(ids) - self.suffix :]) if self.suffix else [])
        return list(ids) + [self.pad_id] * (self.length - len(ids))


_RULES: dict[tuple[int, int], tuple[Any, _PadRule | None]] = {}
"""(id(tokenizer), length) -> (the tokenizer, its checked rule or None when the rule does not hold)."""
_RULES_LOCK = threading.Lock()


def _derive(tokenizer: Any, length: int) -> _PadRule | None:
    """The rule for `tokenizer` at `length`, checked on the probes (on a private copy: a fast tokenizer keeps
    its truncation / padding settings on the object for the length of a call); None when it does not hold."""
    own = copy.deepcopy(tokenizer)

    def ids(text: str, **kwargs: Any) -> list[int]:
        return list(own(text, verbose=False, **kwargs)["input_ids"])

    if getattr(own, "padding_side", "right") != "right" or getattr(own, "pad_token_id", None) is None:
        return None
    plain, framed = ids("a b c", add_special_tokens=False), ids("a b c", add_special_tokens=True)
    starts = [i for i in range(len(framed) - len(plain) + 1) if framed[i : i + len(plain)] == plain]
    if not plain or not starts:
        return None
    suffix = len(framed) - starts[0] - len(plain)
    rule = _PadRule(length, suffix, int(own.pad_token_id), tuple(ids("", add_special_tokens=True)))
    if suffix >= length:
        return None
    for text in (*_PROBES, " ".join(["word"] * (2 * length))):
        full = ids(text, add_special_tokens=True, truncation=False)
        want = ids(text, padding="max_length", max_length=length, truncation=True)
        if rule.apply(full) != want:
            return None
    return rule


def _rule(tokenizer: Any, length: int) -> _PadRule | None:
    with _RULES_LOCK:
        entry = _RULES.get((id(tokenizer), length))
        if entry is None or entry[0] is not tokenizer:
            entry = _RULES[(id(tokenizer), length)] = (tokenizer, _derive(tokenizer, length))
        return entry[1]


def carried(batch: Sequence[Any], key: str, stamp: str) -> dict[str, tuple[int, ...]]:
    """The ids the requests of `batch` carry for tokenizer `key` (their `text_ids`), by text: only those made by a
    tokenizer whose fingerprint is `stamp` (the encode's own)."""
    found: dict[str, tuple[int, ...]] = {}
    for params in batch:
        made: TokenIds | None = (params.text_ids or {}).get(key)
        if made is not None and made.tokenizer == stamp:
            for text, ids in made.ids.items():
                found.setdefault(text, ids)
    return found


def padded_ids(
    tokenizer: Any, key: str, texts: Sequence[str], batch: Sequence[Any], max_length: int
) -> torch.Tensor | None:
    """`tokenizer(texts, padding="max_length", max_length=max_length, truncation=True).input_ids`, built from
    the ids the batch's requests carry instead of tokenizing again (texts that came without ids, such as the
    empty negative text or a request no route counted, are tokenized here, once). None when the tokenizer's own
    output does not follow the rule: the caller tokenizes as before."""
    rule = _rule(tokenizer, max_length)
    if rule is None:
        return None
    found = carried(batch, key, fingerprint(tokenizer))
    missing = [text for text in dict.fromkeys(texts) if text not in found and text != ""]
    if missing:
        fresh = tokenizer(missing, truncation=False, add_special_tokens=True, verbose=False)["input_ids"]
        found.update(zip(missing, (tuple(ids) for ids in fresh), strict=True))
    return torch.tensor([rule.apply(found.get(text, rule.empty)) for text in texts], dtype=torch.long)
