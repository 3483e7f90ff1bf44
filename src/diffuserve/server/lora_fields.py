"""The `lora` request field and adapter names as `model`: checked against the adapters loaded at start-up
(`--lora-modules`) before anything is queued, each failure a 400 naming the field."""

from __future__ import annotations

from typing import Any

from diffuserve.config.lora import LORA_SCALE_RANGE
from diffuserve.errors import InvalidRequestError
from diffuserve.server.context import ServerContext


def adapter_names(ctx: ServerContext) -> list[str]:
    """The adapters this server loaded, in flag order."""
    return list(ctx.args.lora.adapters)


def request_loras(ctx: ServerContext, lora: Any, model: str | None) -> tuple[tuple[str, float], ...]:
    """The request's (adapter, scale) pairs from its `lora` field and a `model` that names an adapter."""
    loaded = adapter_names(ctx)
    if lora is None:
        entries: list[tuple[str, float]] = []
    elif isinstance(lora, str):
        entries = [(lora, 1.0)]
    else:
        entries = [(entry.name, float(entry.scale)) for entry in lora]
    if model is not None and model in loaded and model not in (name for name, _ in entries):
        entries.append((model, 1.0))
    low, high = LORA_SCALE_RANGE
    seen: set[str] = set()
    for i, (name, scale) in enumerate(entries):
        if name not in loaded:
            have = f"loaded: {', '.join(loaded)}" if loaded else "none is loaded (serve with --lora-modules NAME=PATH)"
            raise InvalidRequestError(
                f"lora: no adapter named {name!r} ({have}; GET /v1/models lists them).", param="lora"
            )
        if not low <= scale <= high:
            raise InvalidRequestError(f"lora[{i}].scale={scale} is outside [{low}, {high}].", param="lora")
        if name in seen:
            raise InvalidRequestError(f"lora: {name!r} is given twice; give each adapter once.", param="lora")
        seen.add(name)
    return tuple(entries)


def base_model_name(ctx: ServerContext, model: str | None) -> str | None:
    """`model` for the server's model-name check: an adapter name stands for the base model it adapts."""
    return None if model is not None and model in adapter_names(ctx) else model
