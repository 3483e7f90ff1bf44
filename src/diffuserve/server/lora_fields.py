"""The `lora` request field and adapter names as `model`: checked against the adapters the server knows (start-up
`--lora-modules` and runtime loads) before anything is queued, each failure a 400 naming the field."""

from __future__ import annotations

from typing import Any

from diffuserve.config.lora import LORA_SCALE_RANGE
from diffuserve.errors import InvalidRequestError
from diffuserve.lora.files import lora_families
from diffuserve.lora.registry import LoraRegistry, lora_registry
from diffuserve.server.context import ServerContext


def registry_of(ctx: ServerContext) -> LoraRegistry:
    """The process's adapter registry (shared with the pipeline that applies the adapters)."""
    return lora_registry(ctx.args.lora)


def adapter_names(ctx: ServerContext) -> list[str]:
    """The adapters new requests may select, start-up ones first, then runtime loads in load order."""
    return registry_of(ctx).names() if ctx.args.lora.enabled else []


def _check_family(ctx: ServerContext) -> None:
    """A request that names adapters on a model whose family takes none: 400 naming `lora`."""
    model = ctx.engine.model
    # With adapters loaded the family takes them (a diffusers-backend family too, one adapter set per call).
    if model is not None and not adapter_names(ctx) and model.family not in lora_families():
        raise InvalidRequestError(
            f"lora: the served {model.family} model takes no LoRA adapters (per-request LoRA is available for: "
            f"{', '.join(lora_families())}); drop the field.",
            param="lora",
        )


def _entries(ctx: ServerContext, lora: Any, model: str | None, loaded: list[str]) -> list[tuple[str, float]]:
    """The (name, scale) pairs a request asks for: its `lora` field, an adapter as `model`, else the default
    adapters of `POST /v1/set_lora`."""
    if lora is None:
        entries: list[tuple[str, float]] = []
    elif isinstance(lora, str):
        entries = [(lora, 1.0)]
    else:
        entries = [(entry.name, float(entry.scale)) for entry in lora]
    if model is not None and model in loaded:
        others = [name for name, _ in entries if name != model]
        if others:  # ambiguous (`model` says this adapter alone, `lora` adds others): refused rather than guessed
            listed = ", ".join(f'{{"name": "{name}"}}' for name in [model, *others])
            raise InvalidRequestError(
                f"lora: model {model!r} selects that adapter alone, and lora names {', '.join(map(repr, others))} "
                f"too; to apply several adapters give model {ctx.args.public_model_name!r} (or leave it out) and "
                f"list them all in lora: [{listed}].",
                param="lora",
            )
        if not entries:
            entries.append((model, 1.0))
    if lora is None and not entries and ctx.args.lora.enabled:
        entries = list(registry_of(ctx).default)
    return entries


def request_loras(ctx: ServerContext, lora: Any, model: str | None) -> tuple[tuple[str, float], ...]:
    """The request's (adapter, scale) pairs from its `lora` field, a `model` that names an adapter, or the server's
    default adapters; counted on /metrics per adapter."""
    loaded = adapter_names(ctx)
    entries = _entries(ctx, lora, model, loaded)
    if not entries:
        return ()
    _check_family(ctx)
    low, high = LORA_SCALE_RANGE
    seen: set[str] = set()
    for i, (name, scale) in enumerate(entries):
        if name not in loaded:
            have = f"loaded: {', '.join(loaded)}" if loaded else "none is loaded (serve with --lora-modules NAME=PATH)"
            if ctx.args.lora.enabled and registry_of(ctx).get(name) is not None:
                have = "it is being unloaded; " + have
            raise InvalidRequestError(
                f"lora: no adapter named {name!r} ({have}; GET /v1/models lists them).", param="lora"
            )
        if not low <= scale <= high:
            raise InvalidRequestError(f"lora[{i}].scale={scale} is outside [{low}, {high}].", param="lora")
        if name in seen:
            raise InvalidRequestError(f"lora: {name!r} is given twice; give each adapter once.", param="lora")
        seen.add(name)
    if len(entries) > ctx.args.lora.max_loras:
        raise InvalidRequestError(
            f"lora: {len(entries)} adapters in one request, but the server holds at most {ctx.args.lora.max_loras} on "
            "the device at once (--max-loras); give fewer.",
            param="lora",
        )
    for name, _ in entries:
        ctx.metrics.lora_requests.labels(adapter=name).inc()
    return tuple(entries)


def base_model_name(ctx: ServerContext, model: str | None) -> str | None:
    """`model` for the server's model-name check: an adapter name stands for the base model it adapts."""
    return None if model is not None and model in adapter_names(ctx) else model
