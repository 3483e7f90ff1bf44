"""Runtime adapter changes (behind `--enable-lora-updates`, paths only under `--lora-root`).

vLLM's `POST /v1/load_lora_adapter {lora_name, lora_path}` and `POST /v1/unload_lora_adapter {lora_name}` (plain-text
`Success: ...` answers, as vLLM gives), and SGLang's `GET /v1/list_loras` and `POST /v1/set_lora` (the adapters a
request that names none gets). A load reads and checks the adapter in a worker thread and only registers it; the
thread that runs the batches writes it into a device slot before the first batch that uses it (`lora/slots.py`).

An unload **waits**, in every batching mode: the adapter is refused to new requests at once, the answer comes once no
queued or running request uses it any more (`AsyncEngine.requests_using_adapter`: queued requests, running batches,
and the rows of a continuous denoise group), and only then are its weights dropped. (A request validated in the
instant before the unload began but queued after it ended fails, naming the adapter.) After every load and unload
the exact-result cache drops the entries made with weights a name no longer selects (`server/result_cache.py`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from diffuserve.config.lora import LORA_SCALE_RANGE
from diffuserve.errors import ConfigError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from diffuserve.lora.registry import AdapterEntry, LoraRegistry
from diffuserve.server.common import server_context
from diffuserve.server.context import ServerContext
from diffuserve.server.lora_fields import registry_of

logger = logging.getLogger("diffuserve.server")
router = APIRouter()

UNLOAD_POLL_S = 0.02
"""How often an unload looks again for queued or running requests that use the adapter."""
_TEXT = {200: {"content": {"text/plain": {}}, "description": "Success: ... (vLLM's plain-text answer)."}}


class LoadLoraAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256, description="The name requests select the adapter by.")
    lora_path: str = Field(
        min_length=1, description="Folder or .safetensors file under --lora-root (relative paths are taken from it)."
    )


class UnloadLoraAdapterRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, description="The adapter to unload.")
    lora_int_id: int | None = Field(default=None, description="Accepted for vLLM compatibility; ignored.")


class SetLoraRequest(BaseModel):
    """Body of POST /v1/set_lora (SGLang's): the adapters requests that name none get."""

    model_config = ConfigDict(extra="forbid")
    lora_nickname: str | list[str] | None = Field(
        default=None, description="Adapter name(s); null or [] clears the default."
    )
    lora_path: str | list[str | None] | None = Field(
        default=None, description="Per name, a path under --lora-root to load it from when it is not loaded yet."
    )
    target: str | list[str] = Field(default="all", description="all or transformer (one transformer is adapted).")
    strength: float | list[float] = Field(default=1.0, description="Scale per adapter (summed, as `lora`).")


def _require_updates(ctx: ServerContext, param: str) -> LoraRegistry:
    """The registry, once runtime changes are on and the model can read adapters; else a 4xx / 503."""
    if not ctx.args.lora.enable_lora_updates:
        raise InvalidRequestError(
            f"{param}: runtime adapter changes are off on this server; start it with --enable-lora-updates "
            "--lora-root DIR (or load adapters at start-up with --lora-modules NAME=PATH).",
            param=param,
            code="lora_updates_disabled",
        )
    registry = registry_of(ctx)
    if registry.reader is None:
        raise ServiceUnavailableError("The model is still loading; adapters can be loaded once /health is 200.")
    return registry


def _under_root(ctx: ServerContext, path: str) -> str:
    """`path` resolved (symlinks too), refused unless it is an existing file or folder under --lora-root."""
    root = Path(str(ctx.args.lora.lora_root)).resolve()
    given = Path(path)
    full = (given if given.is_absolute() else root / given).resolve()
    if not full.is_relative_to(root):
        raise InvalidRequestError(
            f"lora_path {path!r} is outside --lora-root {str(root)!r}; runtime loads read only under it.",
            param="lora_path",
        )
    if not full.exists():
        raise InvalidRequestError(f"lora_path {path!r} does not exist under --lora-root.", param="lora_path")
    return str(full)


async def _load(ctx: ServerContext, registry: LoraRegistry, name: str, path: str) -> AdapterEntry:
    """Read, check and register one adapter (the device slot is filled by the batch thread when first used)."""
    if name in ctx.args.model_names:
        raise InvalidRequestError(f"lora_name {name!r} is the base model's name; pick another.", param="lora_name")
    if registry.get(name) is not None:
        raise InvalidRequestError(
            f"The lora adapter {name!r} has already been loaded; unload it first or pick another name.",
            param="lora_name",
        )
    full = _under_root(ctx, path)
    try:
        adapter = await run_in_threadpool(registry.read, name, full)
    except ConfigError as exc:  # does not fit the served transformer: name the first module, as at start-up
        message = exc.message
        for prefix in (f"--lora-modules {name}={full}", f"--lora-modules {name}", "--lora-modules"):
            if message.startswith(prefix):
                message = f"lora_path {path!r}" + message[len(prefix) :]
                break
        raise InvalidRequestError(message, param="lora_path") from exc
    try:
        entry = registry.add(name, full, adapter)
    except KeyError:  # a concurrent load of the same name won
        raise InvalidRequestError(f"The lora adapter {name!r} has already been loaded.", param="lora_name") from None
    logger.info(
        "LoRA adapter %r loaded from %s (rank %d, %d modules, fingerprint %s)",
        name,
        full,
        adapter.rank,
        len(adapter.modules),
        entry.fingerprint,
    )
    _drop_stale_results(ctx)
    return entry


def _drop_stale_results(ctx: ServerContext) -> None:
    """The exact-result cache forgets the answers made with weights an adapter name no longer selects."""
    if ctx.result_cache is not None:
        dropped = ctx.result_cache.drop_stale_adapters()
        if dropped:
            logger.info("result cache: dropped %d answer(s) made with adapters that are gone", dropped)


@router.post("/v1/load_lora_adapter", tags=["lora"], responses=_TEXT)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    ctx = server_context(request)
    await _load(ctx, _require_updates(ctx, "lora_path"), body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", tags=["lora"], responses=_TEXT)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    ctx = server_context(request)
    registry = _require_updates(ctx, "lora_name")
    try:
        entry = registry.begin_unload(body.lora_name)
    except KeyError:
        raise NotFoundError(f"The lora adapter {body.lora_name!r} cannot be found.", param="lora_name") from None
    while ctx.engine.requests_using_adapter(entry.name):  # wait: the requests that chose it finish with it
        await asyncio.sleep(UNLOAD_POLL_S)
    registry.finish_unload(entry)
    logger.info("LoRA adapter %r unloaded", entry.name)
    _drop_stale_results(ctx)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _listing(ctx: ServerContext) -> dict:
    """SGLang's list_loras shape, plus the tiers and their sizes."""
    registry = registry_of(ctx)
    entries = [e for e in registry.entries() if not e.unloading]
    paths = {e.name: e.path for e in entries}
    return {
        "loaded_adapters": [{"nickname": e.name, "path": e.path, "runtime": e.runtime} for e in entries],
        "active": {
            "transformer": [
                {"nickname": n, "path": paths.get(n), "merged": False, "strength": s} for n, s in registry.default
            ]
        },
        "adapters": registry.counts(),
        "max_loras": ctx.args.lora.max_loras,
        "max_cpu_loras": ctx.args.lora.host_capacity,
    }


@router.get("/v1/list_loras", tags=["lora"])
async def list_loras(request: Request) -> dict:
    return _listing(server_context(request))


def _spread(value: object, n: int, param: str) -> list:
    """One value per adapter: a list of the adapters' length, or one value for all."""
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(f"{param} has {len(value)} entries for {n} adapter(s).", param=param)
        return value
    return [value] * n


@router.post("/v1/set_lora", tags=["lora"])
async def set_lora(body: SetLoraRequest, request: Request) -> dict:
    ctx = server_context(request)
    registry = _require_updates(ctx, "lora_nickname")
    raw = body.lora_nickname
    names: list[str] = [] if raw is None else [raw] if isinstance(raw, str) else list(raw)
    paths, strengths = _spread(body.lora_path, len(names), "lora_path"), _spread(body.strength, len(names), "strength")
    low, high = LORA_SCALE_RANGE
    for target in _spread(body.target, len(names), "target"):
        if target not in ("all", "transformer"):
            raise InvalidRequestError(f"target {target!r}: give all or transformer.", param="target")
    for strength in strengths:
        if not low <= strength <= high:
            raise InvalidRequestError(f"strength={strength} is outside [{low}, {high}].", param="strength")
    if len(set(names)) != len(names) or len(names) > ctx.args.lora.max_loras:
        raise InvalidRequestError(
            f"lora_nickname: give each adapter once, at most --max-loras {ctx.args.lora.max_loras}.",
            param="lora_nickname",
        )
    for name, path in zip(names, paths, strict=True):
        entry = registry.get(name)
        if entry is None and path is None:
            raise InvalidRequestError(
                f"lora_nickname {name!r} is not loaded; give its lora_path.", param="lora_nickname"
            )
        if entry is None:
            await _load(ctx, registry, name, path)
        elif entry.unloading or (path is not None and _under_root(ctx, path) != entry.path):
            raise InvalidRequestError(
                f"lora_path: {name!r} is loaded from {entry.path!r} (or being unloaded); unload it first.",
                param="lora_path",
            )
    registry.default = tuple(zip(names, (float(s) for s in strengths), strict=True))
    logger.info("LoRA default adapters: %s", ", ".join(f"{n}={s:g}" for n, s in registry.default) or "none")
    return _listing(ctx)
