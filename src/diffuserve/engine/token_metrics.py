"""The token side of batching in `/metrics` and the log lines: tokens per call, packed calls, padding waste.

A *packed call* holds rows of more than one size (a family that packs mixed sizes, engine/scheduler.py rule 3).
Its *padding* is what a rectangular call of the same rows would add, every row padded to the largest one's tokens
(`ScheduledBatch.padding_tokens`): the waste packing avoids; 0 for a batch of one size. Rows per call are
`diffuserve_batch_size` (dynamic) and `diffuserve_continuous_step_batch_rows` (continuous).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from diffuserve.engine.decisions import ScheduledBatch

PREFIX = "diffuserve_"
TOKEN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
"""Latent tokens per call: a 512x512 row is 1024 tokens at a 16-pixel token side, a 1024x1024 one 4096."""


class TokenMetrics:
    """The token collectors, on the engine's registry; `mode` labels say `dynamic` (one per dispatch) or
    `continuous` (one per denoising step)."""

    def __init__(self, registry: CollectorRegistry):
        r, p = registry, PREFIX
        self.tokens = Histogram(
            f"{p}batch_tokens", "Latent tokens per call (rows x tokens per row).", ["mode"], buckets=TOKEN_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.packed_calls = Counter(
            f"{p}packed_calls", "Calls whose rows have more than one size (packed).", ["mode"], registry=r
        )
        self.padding_tokens = Counter(
            f"{p}batch_padding_tokens",
            "Tokens a rectangular call of the same rows would pad (rows x largest row - tokens): what packing saves.",
            ["mode"],
            registry=r,
        )
        self.token_budget = Gauge(f"{p}token_budget", "Latent tokens one batch or group may hold.", registry=r)

    def record_batch(self, mode: str, batch: ScheduledBatch) -> None:
        """One dispatch of the request-level schedulers."""
        self.record(mode, batch.num_tokens, batch.num_sizes, batch.padding_tokens, batch.token_budget)

    def record(self, mode: str, tokens: int, sizes: int, padding: int, budget: int | None) -> None:
        """One call: its tokens, distinct sizes and padding, and the budget it was filled against."""
        self.tokens.labels(mode=mode).observe(tokens)
        if sizes > 1:
            self.packed_calls.labels(mode=mode).inc()
            self.padding_tokens.labels(mode=mode).inc(padding)
        if budget is not None:
            self.token_budget.set(budget)


def format_tokens(tokens: int, sizes: int, padding: int, budget: int | None) -> str:
    """The log lines' token fields: `, tokens=T/B` (budget when there is one), `, packed_sizes=K, padding_tokens=P`
    for a packed call; empty when neither applies (a scheduler without a budget)."""
    text = f", tokens={tokens}/{budget}" if budget is not None else ""
    return text + (f", packed_sizes={sizes}, padding_tokens={padding}" if sizes > 1 else "")
