"""How many tokens a prompt takes in each text encoder, so a too-long prompt is reported, not silently cut,
and the `usage` text tokens of a response.

Family-agnostic: a family spec lists its text encoders (`family_spec.base.TextEncoderFacts`); a loaded pipeline
turns them into `TextEncoderLimit`s (its tokenizer + the most tokens the encoder is given, special tokens
included) with `checkpoint_counter` (its tokenizers and its `text_readings`), and describes them to the front end
as plain data (`table`: each encoder's tokenizer folder and its limit net of the pipeline's framing,
`family_spec/text_tokens.EncoderLimit`). The front end builds its own `PromptTokens` from that table
(`prompt_counter`: the tokenizers loaded from their folders, never the engine's objects) and counts a request's
texts once, for prompt limits, truncation warnings and usage together, off the event loop, before queueing the
request; it warns (or, with `--reject-truncated-prompts`, refuses).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffuserve.family_spec.text_tokens import EncoderLimit, TokenIds

if TYPE_CHECKING:
    from diffuserve.sampling import ModelDescription

logger = logging.getLogger(__name__)


_FINGERPRINT_PROBE = "A photo of 2 cats, résumé; 東京 <x> ..."
"""A text whose ids tell tokenizers apart (case, digits, accents, CJK, markup, punctuation)."""
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""Tokenizer -> its fingerprint (made once per tokenizer object; forgotten with it)."""
_FINGERPRINTS_LOCK = threading.Lock()


def fingerprint(tokenizer: Any) -> str:
    """A stamp of what `tokenizer` makes of text: its class, its vocabulary size and its ids of a probe text. Two
    tokenizers loaded from the same folder (the engine's and the front end's) have the same stamp; counted on a
    private copy (a fast tokenizer keeps its truncation settings on the object for the length of a call)."""
    with _FINGERPRINTS_LOCK:
        stamp = _FINGERPRINTS.get(tokenizer)
        if stamp is None:
            own = copy.deepcopy(tokenizer)
            ids = own(_FINGERPRINT_PROBE, truncation=False, add_special_tokens=True, verbose=False)["input_ids"]
            name = getattr(type(own), "__name__", "")
            vocab = own.get_vocab() if callable(getattr(own, "get_vocab", None)) else {}
            text = f"{name}|{len(vocab)}|{list(ids)}"
            stamp = _FINGERPRINTS[tokenizer] = hashlib.sha1(text.encode()).hexdigest()[:16]
        return stamp


@dataclass(frozen=True)
class TextEncoderLimit:
    """One text encoder's input limit."""

    encoder: str
    """Name shown to users, e.g. `text_encoder_2 (T5)`."""
    tokenizer: Any
    """The encoder's tokenizer (a transformers tokenizer: callable, returns `input_ids`)."""
    max_tokens: int | None
    """Tokens the pipeline feeds the encoder, special tokens included; the rest is cut off. None: the whole
    text (it is never cut, so never reported; it still counts as usage)."""
    framed_empty: Callable[[Any], int] | None = None
    """Tokens the encoder is given for an empty text, counted with a given tokenizer: the pipeline's framing
    (chat template, system message, after any prefix it drops) takes that much of `max_tokens` from every
    text. None: the text alone. Only `PromptTokens` applies it (on its private copy)."""
    key: str | None = None
    """The tokenizer's model_index key (`tokenizer_2`): the count's ids are carried to the encode under it
    (`pipelines/token_ids.py`). None: the ids are not carried."""


@dataclass(frozen=True)
class TextReading:
    """How an adapter gives texts to the encoder behind one tokenizer, beyond what the tokenizer declares."""

    cap: int | None = None
    """A cap of the adapter's own on the tokens the encoder reads (e.g. the DiT's text positions); None: none."""
    framed_empty: Callable[[Any], int] | None = None
    """The adapter's framing (chat template, system message): for a given tokenizer, the tokens an empty text
    becomes after any prefix the adapter drops (`TextEncoderLimit.framed_empty`). None: the text alone."""


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
        return (
            f"{self.field} is {self.tokens} tokens for {self.encoder}, which takes {self.max_tokens}; "
            f"the last {self.tokens - self.max_tokens} tokens are cut off"
        )


@dataclass(frozen=True)
class PromptCount:
    """What one count of a request's texts found: everything the server needs from the tokenizers."""

    truncations: tuple[PromptTruncation, ...]
    """Every (field, encoder) pair whose text is longer than the encoder takes (limits and warnings)."""
    text_tokens: int
    """The `usage` text tokens: the texts' tokens in the usage encoder (the spec's last), as far as it reads."""
    text_ids: dict[str, TokenIds] = field(default_factory=dict)
    """Tokenizer key -> its ids of each text (untruncated, special tokens included), stamped with the tokenizer that
    made them: the one tokenization of each text, carried to the encode (`SamplingParams.text_ids`,
    `pipelines/token_ids.py`)."""


class PromptTokens:
    """THE owner of the server's prompt token counts (limits, truncation warnings, usage) for one loaded model.

    It tokenizes only on its own deep copies of the encoders' tokenizers, made once here: a fast (Rust)
    tokenizer keeps its padding / truncation settings on the object for the length of a call, so counting on the
    pipeline's own tokenizer while the encode lane tokenizes a batch changed what the encode got (an unpadded
    27-token T5 row in a batch of 64-token rows, failing `recipe.concat_cond`). Counts run one at a time (the
    copies are not shared between threads) and belong off the event loop: the routes run `count` in a thread.
    """

    def __init__(self, limits: Sequence[TextEncoderLimit], *, usage: TextEncoderLimit | None = None) -> None:
        """`limits`: the encoders whose limits are checked, in the family spec's order; `usage`: the encoder whose
        tokens count as usage (default: the last of `limits`, the long-context T5 of FLUX.1 and SD3; with
        neither, usage counts words)."""
        copies: dict[int, Any] = {}

        def private(limit: TextEncoderLimit) -> TextEncoderLimit:
            if id(limit.tokenizer) not in copies:
                copies[id(limit.tokenizer)] = copy.deepcopy(limit.tokenizer)
            tokenizer, max_tokens = copies[id(limit.tokenizer)], limit.max_tokens
            if limit.framed_empty is not None and max_tokens is not None:
                # What the framing adds beyond the text's own special tokens is not the text's to use.
                max_tokens -= limit.framed_empty(tokenizer) - self._tokens(tokenizer, "", {})
            return TextEncoderLimit(limit.encoder, tokenizer, max_tokens, key=limit.key)

        self.limits: tuple[TextEncoderLimit, ...] = tuple(private(limit) for limit in limits)
        """The checked encoders, each on its private tokenizer copy, `max_tokens` net of the pipeline's framing."""
        chosen = private(usage) if usage is not None else (self.limits[-1] if self.limits else None)
        self.usage: TextEncoderLimit | None = chosen
        """The encoder whose tokens are the `usage` text tokens, on its private copy (None: words)."""
        self._lock = threading.Lock()
        self._stamps = {limit.key: fingerprint(limit.tokenizer) for limit in self.limits if limit.key is not None}
        """Tokenizer key -> the fingerprint its ids are stamped with (made once, here)."""

    @classmethod
    def from_table(
        cls,
        encoders: Sequence[EncoderLimit],
        usage: EncoderLimit | None = None,
        *,
        load: Callable[[EncoderLimit], Any] | None = None,
    ) -> PromptTokens:
        """The front end's counter: each encoder's tokenizer loaded from its folder (`load`, default
        `load_tokenizer`), its limit as described (already net of the framing). An encoder without a folder cannot
        be counted and is left out (logged); `usage` None: the last encoder counted is the usage encoder."""
        loader = load or load_tokenizer
        loaded: dict[str, Any] = {}

        def limit(entry: EncoderLimit) -> TextEncoderLimit | None:
            if entry.folder is None:
                logger.warning("no tokenizer folder for %s: its prompt tokens are not counted", entry.encoder)
                return None
            if entry.folder not in loaded:
                loaded[entry.folder] = loader(entry)
            return TextEncoderLimit(entry.encoder, loaded[entry.folder], entry.max_tokens, key=entry.key)

        limits = [x for x in (limit(e) for e in encoders) if x is not None]
        return cls(limits, usage=limit(usage) if usage is not None else None)

    def table(self) -> tuple[tuple[EncoderLimit, ...], EncoderLimit | None]:
        """This counter as plain data for another process (`PromptTokens.from_table`): each encoder's tokenizer
        folder and class, and its limit net of the framing; the usage encoder when it is not the last one."""

        def entry(limit: TextEncoderLimit) -> EncoderLimit:
            folder = str(getattr(limit.tokenizer, "name_or_path", "") or "")
            return EncoderLimit(
                encoder=limit.encoder,
                key=limit.key,
                folder=folder if folder and Path(folder).is_dir() else None,
                tokenizer_class=type(limit.tokenizer).__name__,
                max_tokens=limit.max_tokens,
            )

        encoders = tuple(entry(limit) for limit in self.limits)
        last = self.limits[-1] if self.limits else None
        return encoders, (entry(self.usage) if self.usage is not None and self.usage is not last else None)

    def count(self, texts: Mapping[str, str | None]) -> PromptCount:
        """Count `texts` (request field -> text; None/empty texts count nothing) once for every purpose: each text
        is tokenized once per tokenizer, and those ids are returned for the encode (`PromptCount.text_ids`)."""
        truncations: list[PromptTruncation] = []
        text_tokens = 0
        text_ids: dict[str, dict[str, tuple[int, ...]]] = {}
        with self._lock:
            for field_name, text in texts.items():
                if not text:
                    continue
                counted: dict[int, tuple[int, ...]] = {}  # id(private tokenizer) -> ids: one tokenization each
                for limit in self.limits:
                    tokens = len(self._ids(limit, text, counted, text_ids))
                    if limit.max_tokens is not None and tokens > limit.max_tokens:
                        truncations.append(PromptTruncation(field_name, limit.encoder, tokens, limit.max_tokens))
                if self.usage is None:
                    text_tokens += len(text.split())
                else:
                    tokens = len(self._ids(self.usage, text, counted, text_ids))
                    text_tokens += tokens if self.usage.max_tokens is None else min(tokens, self.usage.max_tokens)
        stamped = {key: TokenIds(self._stamps[key], ids) for key, ids in text_ids.items() if key in self._stamps}
        return PromptCount(tuple(truncations), text_tokens, stamped)

    def _ids(
        self,
        limit: TextEncoderLimit,
        text: str,
        counted: dict[int, tuple[int, ...]],
        text_ids: dict[str, dict[str, tuple[int, ...]]],
    ) -> tuple[int, ...]:
        if id(limit.tokenizer) not in counted:
            counted[id(limit.tokenizer)] = self._tokenize(limit.tokenizer, text)
        ids = counted[id(limit.tokenizer)]
        if limit.key is not None:
            text_ids.setdefault(limit.key, {})[text] = ids
        return ids

    def tokens(self, text: str) -> int:
        """Tokens of `text` (special tokens included) in the usage encoder, uncut: for a model's own checks
        (Qwen-Image 2.1 bounds its templated prompt by its RoPE table). Words when no tokenizer is known."""
        if self.usage is None:
            return len(text.split())
        with self._lock:
            return self._tokens(self.usage.tokenizer, text, {})

    @staticmethod
    def _tokenize(tokenizer: Any, text: str) -> tuple[int, ...]:
        # verbose=False: transformers otherwise logs "sequence length is longer than the maximum" itself.
        return tuple(tokenizer(text, truncation=False, add_special_tokens=True, verbose=False)["input_ids"])

    @classmethod
    def _tokens(cls, tokenizer: Any, text: str, counted: dict[int, int]) -> int:
        if id(tokenizer) not in counted:
            counted[id(tokenizer)] = len(cls._tokenize(tokenizer, text))
        return counted[id(tokenizer)]


def checkpoint_limits(
    family: str, part_of: Callable[[str], Any], readings: Mapping[str, TextReading] | None = None
) -> list[TextEncoderLimit]:
    """What each text encoder of a loaded checkpoint takes: the family spec's text encoders, each limited by what its
    tokenizer declares and by the adapter's `readings` (per model_index tokenizer key). `part_of(key)` is the loaded
    tokenizer or processor of model_index key `key`, None when the checkpoint has none (SD3 without T5: skipped).
    These hold the pipeline's own tokenizer objects: count only through a `PromptTokens`, which copies them."""
    from diffuserve.family_spec import spec_for

    try:
        facts = spec_for(family).text_encoders
    except KeyError:
        facts = ()
    limits = []
    for fact in facts:
        part = part_of(fact.tokenizer)
        if part is None:
            continue
        tokenizer = inner_tokenizer(part)
        reading = (readings or {}).get(fact.tokenizer, TextReading())
        limit = declared_limit(tokenizer, fact.max_tokens)
        if reading.cap is not None and limit is not None:
            limit = min(limit, reading.cap)
        limits.append(TextEncoderLimit(fact.label, tokenizer, limit, reading.framed_empty, key=fact.tokenizer))
    return limits


def checkpoint_counter(
    family: str, part_of: Callable[[str], Any], readings: Mapping[str, TextReading] | None = None
) -> PromptTokens:
    """A loaded checkpoint's prompt counter, built from its tokenizers (`checkpoint_limits`). A family whose spec lists
    no encoders counts `usage` on its longest-context tokenizer (T5 for FLUX / SD3-style pipelines, else the first)
    up to min(declared, 512) tokens."""
    limits = checkpoint_limits(family, part_of, readings)
    if limits:
        return PromptTokens(limits)
    for key in ("tokenizer_3", "tokenizer_2", "tokenizer"):
        part = part_of(key)
        if part is not None and callable(part):
            tokenizer = inner_tokenizer(part)
            declared = getattr(tokenizer, "model_max_length", 512)
            return PromptTokens([], usage=TextEncoderLimit(key, tokenizer, min(int(declared or 512), 512), key=key))
    return PromptTokens([])


def inner_tokenizer(part: Any) -> Any:
    """The tokenizer of a model_index part: itself, or the one a processor holds (Qwen-Image 2.1, the edit
    models, FLUX.2-dev's PixtralProcessor)."""
    return getattr(part, "tokenizer", None) or part


def declared_limit(tokenizer: Any, max_tokens: int | None) -> int | None:
    """`max_tokens` capped by the tokenizer's declared `model_max_length` (the pipelines cap their own
    sequence length the same way; tiny checkpoints declare fewer tokens than the published ones)."""
    declared = getattr(tokenizer, "model_max_length", None)
    if max_tokens is None or not isinstance(declared, int) or declared <= 0:
        return max_tokens
    return min(max_tokens, declared)


def load_tokenizer(entry: EncoderLimit) -> Any:
    """The tokenizer of `entry`, loaded from its folder with the class the engine loaded (local files only)."""
    import transformers
    from transformers import AutoTokenizer

    cls = getattr(transformers, entry.tokenizer_class, None) or AutoTokenizer
    return cls.from_pretrained(entry.folder, local_files_only=True)


_BUILD_LOCK = threading.Lock()
"""One build at a time: the first requests and the start-up build may ask together (and transformers' lazy module
must not be imported from two threads at once)."""


def prompt_counter(encoders: tuple[EncoderLimit, ...], usage: EncoderLimit | None) -> PromptTokens:
    """The front end's prompt counter for a model described by `encoders` / `usage` (its
    `ModelDescription.text_encoders` / `usage_encoder`), built once per process from the tokenizer folders."""
    with _BUILD_LOCK:
        return _built(encoders, usage)


@functools.lru_cache(maxsize=4)
def _built(encoders: tuple[EncoderLimit, ...], usage: EncoderLimit | None) -> PromptTokens:
    return PromptTokens.from_table(encoders, usage)


def with_counter(model: ModelDescription) -> ModelDescription:
    """`model` with this process's prompt counter attached (`prompt_counter` of its `text_encoders`): what the HTTP
    front end and `generate` count and check prompts with, never the engine's pipeline."""
    if model.prompt_tokens is not None:
        return model
    return dataclasses.replace(model, prompt_tokens=prompt_counter(model.text_encoders, model.usage_encoder))
