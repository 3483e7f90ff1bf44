"""Tokenize once: a served request's texts are tokenized once per tokenizer, by the front end's prompt count
(`server/common.check_prompt`, on the front end's own tokenizers loaded from the description's folders), and the
encode reuses those ids (`SamplingParams.text_ids`, stamped with the tokenizer that made them,
`pipelines/token_ids.py`) instead of tokenizing again.

The requests go the route's way (count, carry, `AsyncEngine.generate`) through a dynamic-batching engine on the
tiny FLUX checkpoint, in this process, so counting wrappers around the pipeline's tokenizers and the front end's
see every tokenization, the count's and the encode's (batch encodes and the encode lane's prefetches).
Every row equals its singleton run without carried ids, which tokenizes as before (<= 1/255; found equal).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from diffuserve.family_spec.text_tokens import TokenIds
from diffuserve.models.loader import load_pipeline
from diffuserve.pipelines import token_ids
from diffuserve.pipelines.prompt_limits import PromptTokens, with_counter
from diffuserve.sampling import SamplingParams
from diffuserve.server.common import check_prompt

PROMPTS = [
    "a red fox in fresh snow",
    "a lighthouse at dusk, long exposure",
    " ".join(["a very long prompt that the CLIP encoder cuts"] * 12),  # longer than CLIP's 77 and T5's length
    "a bowl of ramen",
    "an old map of a harbour town",
    "a cat",
]
NEGATIVE = "blurry, low quality"


class CountingTokenizer:
    """A tokenizer that counts, per text, every time it (or a deep copy of it) tokenizes that text."""

    def __init__(self, inner: Any, name: str, counts: Counter, lock: threading.Lock):
        self._inner, self._name, self._counts, self._lock = inner, name, counts, lock

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            for one in [text] if isinstance(text, str) else list(text):
                self._counts[(self._name, one)] += 1
        return self._inner(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __deepcopy__(self, memo: dict) -> CountingTokenizer:  # the token owner's private copies count too
        return CountingTokenizer(copy.deepcopy(self._inner, memo), self._name, self._counts, self._lock)


def _params(prompt: str, seed: int, negative: str | None = None) -> SamplingParams:
    return SamplingParams(
        prompt=prompt,
        negative_prompt=negative,
        true_cfg_scale=2.0 if negative else 1.0,
        width=32,
        height=32,
        num_inference_steps=2,
        seed=seed,
    )


def test_a_served_prompt_is_tokenized_once_per_tokenizer_and_rows_are_unchanged(tiny_flux_path: Path):
    from diffuserve.engine.engine import AsyncEngine, EngineConfig
    from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
    from diffuserve.executor.base import InProcessExecutor, ServingPipeline

    counts: Counter = Counter()
    lock = threading.Lock()
    pipeline = load_pipeline(tiny_flux_path)
    for key in ("tokenizer", "tokenizer_2"):
        setattr(pipeline.adapter, key, CountingTokenizer(pipeline.adapter.component(key), key, counts, lock))
    model = pipeline.describe_model()
    originals = {key: type(pipeline.adapter.component(key)._inner) for key in ("tokenizer", "tokenizer_2")}

    def load(entry: Any) -> CountingTokenizer:  # the front end's tokenizers, from the folders the description names
        return CountingTokenizer(originals[entry.key].from_pretrained(entry.folder), entry.key, counts, lock)

    counter = PromptTokens.from_table(model.text_encoders, model.usage_encoder, load=load)
    front = dataclasses.replace(model, prompt_tokens=counter)
    ctx = SimpleNamespace(
        engine=SimpleNamespace(model=front),
        args=SimpleNamespace(limits=SimpleNamespace(reject_truncated_prompts=False)),
    )
    batcher = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=4, delay_ms=20), model_names=["tiny"])
    engine = AsyncEngine(InProcessExecutor(lambda: ServingPipeline.of(pipeline)), batcher, config=EngineConfig())
    engine.start()
    requests = [_params(p, 10 + i, NEGATIVE if i % 2 else None) for i, p in enumerate(PROMPTS)]
    try:
        assert engine.wait_ready(180) and engine.state.name == "READY", engine.failure
        counts.clear()  # warm-up and the rule checks (token_ids' probes) are not served prompts

        async def serve(params: SamplingParams) -> Any:
            texts = {"prompt": params.prompt, "negative_prompt": params.negative_prompt}
            checked = await asyncio.to_thread(check_prompt, ctx, texts)  # the route's count, in a worker thread
            return await engine.generate(checked.carry(params), endpoint="images")

        async def serve_all() -> list[Any]:
            return await asyncio.gather(*(serve(p) for p in requests))

        results = asyncio.run(serve_all())
    finally:
        engine.stop()
    assert max(r.batch_size for r in results) > 1  # merged batches (and the lane's prefetches) encoded them
    # One tokenization per text per request per tokenizer: the route's count; the encodes made none.
    texts = Counter(t for p in requests for t in (p.prompt, p.negative_prompt) if t)
    for key in ("tokenizer", "tokenizer_2"):
        assert {t: counts[(key, t)] for t in texts} == dict(texts), key
    assert sum(counts.values()) == 2 * sum(texts.values())  # and nothing else was tokenized
    # Each row equals its singleton run without carried ids (which tokenizes in the encode, as before).
    for params, result in zip(requests, results, strict=True):
        assert params.text_ids is None
        reference = pipeline.run([params]).outputs[0].images[0]
        served = np.asarray(result.output.images[0], dtype=np.int16)
        assert np.abs(served - np.asarray(reference, dtype=np.int16)).max() <= 1


def test_padded_ids_equal_the_tokenizers_own_padding(tiny_flux_path: Path):
    """The rule that builds an encoder input from carried ids gives what the tokenizer itself gives, for texts
    shorter and longer than the length and the empty text."""
    pipeline = load_pipeline(tiny_flux_path)
    owner = with_counter(pipeline.describe_model()).prompt_tokens
    texts = [PROMPTS[0], PROMPTS[2], ""]
    carried = owner.count({"prompt": texts[0], "negative_prompt": texts[1]}).text_ids
    batch = [SimpleNamespace(text_ids=carried)]
    # Ids stamped by another tokenizer are never used: bogus ids under a foreign stamp change nothing.
    foreign = [SimpleNamespace(text_ids={k: TokenIds("another", {texts[0]: (1, 2, 3)}) for k in carried})]
    for key, length in (
        ("tokenizer", pipeline.adapter._clip_max_length),
        ("tokenizer_2", pipeline.adapter.max_sequence_length),
    ):
        tokenizer = pipeline.adapter.component(key)
        built = token_ids.padded_ids(tokenizer, key, texts, batch, length)
        want = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        assert built is not None and built.tolist() == want.input_ids.tolist()
        assert token_ids.carried(batch, key, token_ids.fingerprint(tokenizer))  # the front end's stamp matched
        built = token_ids.padded_ids(tokenizer, key, texts, foreign, length)
        assert built is not None and built.tolist() == want.input_ids.tolist()
        # A text that came without ids is tokenized in the encode (once), with the same result.
        mixed = [*texts, "not counted"]
        built = token_ids.padded_ids(tokenizer, key, mixed, batch, length)
        want = tokenizer(mixed, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        assert built is not None and built.tolist() == want.input_ids.tolist()
