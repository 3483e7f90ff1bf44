"""GLM-Image's autoregressive stage, batched across requests with per-request randomness.

`GlmImagePipeline` runs an AR model (`vision_language_encoder.generate`, sampling) that writes the image's
prior tokens, then the DiT and VAE. Its own `generate_prior_tokens` takes a prompt list and runs one batched
`generate`, but seeds the global torch RNG from ONE generator and samples every row from it, so a row's
tokens would depend on what it was merged with. `row_sampling` keeps the pipeline's own AR stage and only
changes who draws: each row draws from its own generator (the request's seed), exactly as a solo call draws
from the global RNG seeded with that seed. So a merged row's prior tokens equal its solo run's, and a solo
run equals `GlmImagePipeline.__call__`'s.

How: the model's sampling warpers (temperature, top-k, top-p of its generation config) are moved into one
logits processor that also samples each row with its generator and returns a one-hot distribution; the
generate loop's own multinomial then can only pick that token. The DiT and VAE run per request afterwards
(`GlmImagePipeline.__call__` with `prior_token_ids`), so nothing else changes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_SUPPORTED_WARPERS = ("temperature", "top_k", "top_p")
_OTHER_SAMPLING_KNOBS = (
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_h",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "watermarking_config",
)


def _resolved(config: Any, key: str) -> Any:
    """A generation-config value as `generate` uses it: unset (None) means transformers' global default
    (e.g. top_k=50), not "off"."""
    value = getattr(config, key, None)
    return type(config)._get_default_generation_params().get(key) if value is None else value


def can_batch(model: Any) -> bool:
    """Whether `row_sampling` reproduces this AR model's sampling (its generation config uses only the
    temperature / top-k / top-p warpers); otherwise requests run the pipeline one at a time."""
    config, plain = model.generation_config, type(model.generation_config)()
    return all(_resolved(config, k) == _resolved(plain, k) for k in _OTHER_SAMPLING_KNOBS)


class _RowSampler:
    """Logits processor: apply the model's warpers, draw each row from its own generator, return one-hot scores."""

    def __init__(self, warpers: list[Any], generators: Sequence[torch.Generator]) -> None:
        self.warpers = warpers
        self.generators = list(generators)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        if probs.shape[0] != len(self.generators):
            raise RuntimeError(f"GLM-Image AR: {probs.shape[0]} rows but {len(self.generators)} generators")
        # The generators are CPU generators (as everywhere in diffuserve), so the draw happens on the CPU.
        picks = torch.cat(
            [torch.multinomial(probs[j : j + 1].float().cpu(), 1, generator=g) for j, g in enumerate(self.generators)]
        ).to(scores.device)
        one_hot = torch.full_like(scores, float("-inf"))
        return one_hot.scatter_(1, picks, 0.0)


def _warpers(config: Any) -> list[Any]:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature, top_k, top_p = (_resolved(config, k) for k in _SUPPORTED_WARPERS)
    warpers: list[Any] = []
    # Same order and conditions as transformers' generate builds them.
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


@contextlib.contextmanager
def row_sampling(model: Any, generators: Sequence[torch.Generator]) -> Iterator[None]:
    """While active, `model.generate` samples row j from `generators[j]` (see the module docstring)."""
    from transformers import LogitsProcessorList

    sampler = _RowSampler(_warpers(model.generation_config), generators)
    # The built-in warpers are off for this call: the sampler applies them itself, before drawing.
    model.generate = functools.partial(
        type(model).generate.__get__(model),
        logits_processor=LogitsProcessorList([sampler]),
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    try:
        yield
    finally:
        del model.generate


def prior_tokens(
    pipe: Any, prompts: list[str], seeds: list[int], *, height: int, width: int, device: torch.device
) -> torch.Tensor:
    """One batched AR call for `prompts` (row j drawn with seed `seeds[j]`): the (rows, tokens) prior token ids."""
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    with row_sampling(pipe.vision_language_encoder, generators):
        # The pipeline seeds the global RNG from this generator; the rows do not draw from it.
        prior, _, _ = pipe.generate_prior_tokens(
            prompt=prompts,
            height=height,
            width=width,
            device=device,
            generator=torch.Generator("cpu").manual_seed(seeds[0]),
        )
    return prior
