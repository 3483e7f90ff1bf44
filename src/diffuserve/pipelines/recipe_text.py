"""The recipe's text stage (step 1 of `RecipePipeline.run`): each distinct text of a batch through every text encoder
once, gathered to one conditioning row per output; and, in dynamic batching, a queued request's texts encoded ahead
of its batch in the encode lane (`pipelines/text_prefetch.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from diffuserve.pipelines.batch_rows import Cond, concat_cond, gather_rows
from diffuserve.pipelines.lanes import lanes_for

if TYPE_CHECKING:
    from diffuserve.pipelines.adapter import AdapterBase
    from diffuserve.pipelines.base import Residency
    from diffuserve.pipelines.text_prefetch import TextPrefetch
    from diffuserve.sampling import SamplingParams


class _Recipe(Protocol):
    """What the text stage reads of its recipe (`RecipePipeline`)."""

    adapter: AdapterBase
    residency: Residency

    def encode_text(self, key: str, texts: list[str], batch: Sequence[SamplingParams]) -> Cond: ...

    def uses_cfg(self, head: SamplingParams) -> bool: ...


class TextStage:
    """The text stage of one recipe; its prefetch store is made on first use."""

    def __init__(self, recipe: _Recipe) -> None:
        self.recipe = recipe
        self.prefetched: TextPrefetch | None = None
        """Texts encoded in the encode lane ahead of their batch (`prefetch`); None until the first."""

    def encode_batch(self, batch: Sequence[SamplingParams], cfg: bool) -> tuple[Cond, Cond | None]:
        """The batch's conditioning, one row per output (and the negative one when `cfg`)."""
        # Each distinct text is encoded once (negative prompts in the same encoder calls), then gathered to
        # one row per output: request i's row repeated n_i times, as diffusers does for num_images_per_prompt.
        masked = self.recipe.adapter.masked_sequences
        texts = [p.prompt for p in batch]
        if cfg:
            texts += [p.negative_prompt or "" for p in batch]
        unique = list(dict.fromkeys(texts))
        prefetch = self.prefetched
        ready = {t: c for t in unique if prefetch is not None and (c := prefetch.take(t, batch[0])) is not None}
        missing = [t for t in unique if t not in ready]
        encoded = self.encode_texts(missing, batch) if missing else {}
        if ready:  # texts encoded in the lane while the previous batch denoised (pipelines/text_prefetch.py)
            fresh = {t: i for i, t in enumerate(missing)}
            parts = [ready.get(t) or {k: v[fresh[t] : fresh[t] + 1] for k, v in encoded.items()} for t in unique]
            encoded = parts[0]
            for part in parts[1:]:
                encoded = concat_cond(encoded, part, masked)
        slot = {text: i for i, text in enumerate(unique)}
        counts = [p.n for p in batch]

        def rows(part: list[str]) -> Cond:
            index = torch.tensor([slot[t] for t, n in zip(part, counts, strict=True) for _ in range(n)])
            return gather_rows(encoded, index, masked)

        k = len(batch)
        return rows(texts[:k]), (rows(texts[k:]) if cfg else None)

    def encode_texts(self, texts: list[str], batch: Sequence[SamplingParams]) -> Cond:
        """`texts` through every text encoder, one row each. One encode at a time (a tokenizer is not
        thread-safe): the encode lane and a request-level batch on the loop's thread may both get here."""
        recipe = self.recipe
        encoded: Cond = {}
        with lanes_for(recipe).encoder_lock:
            for key in recipe.adapter.text_encoders:
                with recipe.residency.use(key):
                    encoded.update(recipe.encode_text(key, texts, batch))
        return encoded

    def encode_rows(self, texts: list[str], requests: list[SamplingParams]) -> list[Cond]:
        """`texts` (of the queued `requests`, which share one signature) through each text encoder in one call,
        cut back to one one-row conditioning per text (masked sequences trimmed to the text's own length)."""
        encoded = self.encode_texts(texts, requests)
        masked = self.recipe.adapter.masked_sequences
        return [gather_rows(encoded, torch.tensor([i]), masked) for i in range(len(texts))]

    def prefetch(self, params: SamplingParams, on_done: Any = None) -> bool:
        """Encode a queued text-only request's texts in the encode lane, beside the running batch; its batch takes
        them. False when there was nothing to do."""
        if params.image_inputs:  # image-conditioned text encoders read the images too
            return False
        from diffuserve.pipelines.text_prefetch import TextPrefetch

        if self.prefetched is None:  # the engine's admission calls this under its lock: made once
            self.prefetched = TextPrefetch(self.recipe, self.encode_rows)
        texts = [params.prompt] + ([params.negative_prompt or ""] if self.recipe.uses_cfg(params) else [])
        return self.prefetched.submit(params, texts, on_done)
