"""What a request costs in latent tokens on the served model, and the token budget the schedulers fill to.

The engine builds both once the model is loaded (`model_token_budget`): the counter sets `Request.row_tokens` at
admission, the budget goes to the scheduler (`token_budget`, engine/scheduler.py rule 4). The rules are
`config/token_budget.py`'s; this module only reads them off the loaded model's description. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffuserve.activation import DIT_WIDTHS
from diffuserve.config.batching import BatchingConfig
from diffuserve.config.token_budget import TokenBudget, largest_size, resolve_token_budget, row_tokens
from diffuserve.sampling import ModelDescription, SamplingParams

FALLBACK_TOKEN_SIDE = 16
"""Pixels per token side of a model whose description states no size multiple (FLUX.1 / SD3's 8 x 2)."""


@dataclass(frozen=True)
class TokenCounter:
    """Latent tokens of one output row of a request on the served model."""

    token_side: int
    """Pixels per token side (the family's VAE factor x patch)."""
    frames_per_latent: int = 1
    """Video: frames per latent frame (the VAE's temporal compression)."""

    def __call__(self, params: SamplingParams) -> int:
        return row_tokens(
            params.width,
            params.height,
            params.num_frames,
            token_side=self.token_side,
            frames_per_latent=self.frames_per_latent,
        )


def token_counter(model: ModelDescription) -> TokenCounter:
    """The counter of the served model: its activation facts' token side where known, else its size multiple."""
    facts = model.activation
    if facts is not None:
        return TokenCounter(facts.token_side, facts.frames_per_latent if facts.kind == "video" else 1)
    side = model.size_multiple if model.size_multiple > 1 else FALLBACK_TOKEN_SIDE
    return TokenCounter(side, max(1, model.frame_multiple))


def largest_model_size(model: ModelDescription) -> tuple[int, int]:
    """The largest size the model allows (config/token_budget.py): its positional limit, else its default size."""
    return largest_size(model.max_width, model.max_height, [(model.defaults.width, model.defaults.height)])


def model_token_budget(
    config: BatchingConfig, model: ModelDescription, memory_bytes: int | None
) -> tuple[TokenBudget | None, TokenCounter]:
    """The token budget for `model` (the flag, or the default of config/token_budget.py, capped by the tokens whose
    DiT activations fit in `memory_bytes`) and its token counter. No budget (rows only, exactly the batching of
    before) when the flag is unset and the model keeps one size per batch (`packs_mixed_sizes` False): a batch of
    one size larger than the default size then still fills the row cap. An explicit budget below one row of the
    largest size was refused at start-up where the plan knew the checkpoint (launch/setup.py); a backend whose sizes
    only the loaded model tells is held to the same rule here."""
    counter = token_counter(model)
    if config.max_tokens is None and not model.packs_mixed_sizes:
        return None, counter
    width, height = largest_model_size(model)
    one_row = counter(SamplingParams(width=width, height=height, num_frames=model.defaults.num_frames))
    facts = model.activation
    per_token = 2 * facts.hidden_size * facts.dtype_bytes * DIT_WIDTHS if facts and facts.kind != "mesh" else None
    budget = resolve_token_budget(
        config.max_tokens,
        config.max_size,
        size=(width, height),
        one_row=one_row,
        memory_bytes=memory_bytes,
        bytes_per_token=per_token,
    )
    return budget, counter
