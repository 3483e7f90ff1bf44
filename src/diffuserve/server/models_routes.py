"""GET /v1/models and /v1/models/{id} (OpenAI shape), with each LoRA adapter as a model whose `parent` is the base
model (vLLM's convention); the runtime adapter routes (`lora_routes.py`) ride on this router."""

from __future__ import annotations

from fastapi import APIRouter, Request

from diffuserve.lora.registry import AdapterEntry
from diffuserve.server import lora_routes
from diffuserve.server.common import server_context, unknown_model
from diffuserve.server.context import ServerContext
from diffuserve.server.lora_fields import registry_of

router = APIRouter()
router.include_router(lora_routes.router)


def _card(ctx: ServerContext) -> dict:
    return {
        "id": ctx.args.public_model_name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "diffuserve",
        "root": ctx.args.model.model_path or ctx.args.public_model_name,
    }


def _adapters(ctx: ServerContext) -> dict[str, AdapterEntry]:
    """The adapters requests may select (start-up and runtime-loaded; not those being unloaded), by name."""
    if not ctx.args.lora.enabled:
        return {}
    return {e.name: e for e in registry_of(ctx).entries() if not e.unloading}


def _adapter_card(ctx: ServerContext, entry: AdapterEntry) -> dict:
    """A LoRA adapter as a model (vLLM's convention): `parent` is the base model, `model: <name>` selects it."""
    created = int(entry.created) if entry.runtime else int(ctx.started_at)
    return {
        **_card(ctx),
        "id": entry.name,
        "created": created,
        "root": entry.path,
        "parent": ctx.args.public_model_name,
    }


@router.get("/v1/models", tags=["models"])
async def list_models(request: Request) -> dict:
    ctx = server_context(request)
    return {"object": "list", "data": [_card(ctx)] + [_adapter_card(ctx, e) for e in _adapters(ctx).values()]}


@router.get("/v1/models/{model_id:path}", tags=["models"])
async def get_model(model_id: str, request: Request) -> dict:
    ctx: ServerContext = server_context(request)
    adapter = _adapters(ctx).get(model_id)
    if adapter is not None:
        return _adapter_card(ctx, adapter)
    if model_id not in ctx.args.model_names:
        raise unknown_model(ctx, model_id)
    return _card(ctx)
