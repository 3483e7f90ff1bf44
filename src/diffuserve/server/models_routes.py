"""GET /v1/models and /v1/models/{id} (OpenAI shape)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from diffuserve.errors import ModelNotFoundError
from diffuserve.server.common import server_context
from diffuserve.server.context import ServerContext

router = APIRouter()


def _card(ctx: ServerContext) -> dict:
    return {
        "id": ctx.args.public_model_name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "diffuserve",
        "root": ctx.args.model_path or ctx.args.public_model_name,
    }


def _adapter_card(ctx: ServerContext, name: str) -> dict:
    """A LoRA adapter as a model (vLLM's convention): `parent` is the base model, `model: <name>` selects it."""
    return {**_card(ctx), "id": name, "root": ctx.args.lora.adapters[name], "parent": ctx.args.public_model_name}


@router.get("/v1/models", tags=["models"])
async def list_models(request: Request) -> dict:
    ctx = server_context(request)
    return {"object": "list", "data": [_card(ctx)] + [_adapter_card(ctx, name) for name in ctx.args.lora.adapters]}


@router.get("/v1/models/{model_id:path}", tags=["models"])
async def get_model(model_id: str, request: Request) -> dict:
    ctx: ServerContext = server_context(request)
    if model_id in ctx.args.lora.adapters:
        return _adapter_card(ctx, model_id)
    if model_id not in ctx.args.model_names:
        raise ModelNotFoundError(
            f"The model {model_id!r} does not exist on this server; it serves {ctx.args.public_model_name!r}.",
            param="model",
        )
    return _card(ctx)
