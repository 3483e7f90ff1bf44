"""Helpers every generation route shares: readiness, the server's request limits, prompt token counts, result
timings."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from diffuserve.config.step_cache import (
    StepCacheSettings,
    parse_step_cache,
    server_step_cache,
    with_calibration,
)
from diffuserve.engine.engine import EngineState, GenerationResult
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.errors import InvalidRequestError, ModelNotFoundError
from diffuserve.family_spec.text_tokens import TokenIds
from diffuserve.pipelines.prompt_limits import prompt_counter, with_counter
from diffuserve.sampling import ModelDescription, SamplingParams
from diffuserve.server.context import ServerContext
from diffuserve.server.lora_fields import adapter_names
from diffuserve.server.protocol import parse_size


def server_context(request: Request) -> ServerContext:
    return request.app.state.ctx


def served_model(ctx: ServerContext) -> ModelDescription | None:
    """The engine's description of the served model (plain data, in either `--api-process` mode) with this
    process's own prompt counter attached, built once from the description's tokenizer folders
    (`pipelines/prompt_limits.prompt_counter`): the routes count and check prompts without the engine's pipeline."""
    model = ctx.engine.model
    return with_counter(model) if model is not None else None


def require_ready(ctx: ServerContext) -> None:
    """503 (with Retry-After) before load and warm-up are done, and while draining."""
    if ctx.engine.state != EngineState.READY or ctx.draining:
        raise ctx.engine.not_ready_error()


def unknown_model(ctx: ServerContext, model: str) -> ModelNotFoundError:
    """As OpenAI answers an unknown model: 404 model_not_found. It names every model name the server takes (the
    base model and its LoRA adapters, which are models too) and the closest one."""
    adapters = adapter_names(ctx)
    served = repr(ctx.args.public_model_name)
    if adapters:
        served += f" and its LoRA adapter(s) {', '.join(repr(a) for a in adapters)}"
    close = difflib.get_close_matches(model, [*ctx.args.model_names, *adapters], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ModelNotFoundError(
        f"Unknown model {model!r}; this server serves {served} (see GET /v1/models).{hint}", param="model"
    )


def check_request_limits(
    ctx: ServerContext,
    *,
    model: str | None,
    texts: dict[str, str | None],
    width: int,
    height: int,
    steps: int,
) -> None:
    """The server's own caps (model name, text length, image side, steps), each naming its field and flag."""
    args = ctx.args
    if model is not None and model not in args.model_names:
        raise unknown_model(ctx, model)
    for name, text in texts.items():
        if text is not None and len(text) > args.limits.max_prompt_chars:
            raise InvalidRequestError(
                f"{name} has {len(text)} characters; the limit is {args.limits.max_prompt_chars} (--max-prompt-chars).",
                param=name,
            )
    for name, value in (("width", width), ("height", height)):
        if value > args.http.max_image_side:
            raise InvalidRequestError(
                f"{name}={value} exceeds the largest side this server allows ({args.http.max_image_side}, "
                "--max-image-side).",
                param="size",
            )
    if steps > args.http.max_inference_steps:
        raise InvalidRequestError(
            f"num_inference_steps={steps} exceeds the limit of {args.http.max_inference_steps} "
            "(--max-inference-steps).",
            param="num_inference_steps",
        )


def resolve_size(size: str | None, width: int | None, height: int | None, default: tuple[int, int]) -> tuple[int, int]:
    """(width, height) from `size` and/or `width`/`height` (the SGLang / vLLM-Omni / FastVideo spelling): given
    together they must agree (else 400 naming the field that differs); a side left out is the default's."""
    if size is None:
        return width or default[0], height or default[1]
    parsed = parse_size(size)
    for name, given, from_size in (("width", width, parsed[0]), ("height", height, parsed[1])):
        if given is not None and given != from_size:
            raise InvalidRequestError(
                f"{name}={given} disagrees with size={size!r} ({name} {from_size}); give size "
                f"or width/height, or make them agree.",
                param=name,
            )
    return parsed


def check_image_only_fields(num_frames: int | None) -> None:
    """An image request may carry `num_frames` (SGLang-Diffusion's clients always send it): 1 means one image."""
    if num_frames is not None and num_frames != 1:
        raise InvalidRequestError(
            f"num_frames={num_frames}: an image request makes one frame per image, so "
            "num_frames may only be 1 (leave it out, or use n for more images; videos: "
            "POST /v1/videos).",
            param="num_frames",
        )


def layer_count(n: int, n_given: bool, layers: int | None) -> int:
    """Qwen-Image-Layered: vLLM-Omni's `layers` is our `n` (the number of layers); both given must agree."""
    if layers is None:
        return n
    if n_given and n != layers:
        raise InvalidRequestError(
            f"layers={layers} and n={n} disagree: both are the number of layers; give one.", param="layers"
        )
    return layers


logger = logging.getLogger("diffuserve.server")


@dataclass(frozen=True)
class PromptCheck:
    """One count of a request's texts, serving its truncation warnings and its usage."""

    warnings: list[str]
    """Texts longer than a text encoder takes (empty when all fit)."""
    text_tokens: int
    """The `usage` text tokens (server/usage.py)."""
    text_ids: dict[str, TokenIds] = field(default_factory=dict)
    """The count's ids of each text per tokenizer, stamped with the tokenizer (`PromptCount.text_ids`): `carry` puts
    them on the request, so the encode does not tokenize the texts again."""

    def carry(self, params: SamplingParams) -> SamplingParams:
        """`params` with this count's token ids for the encode (tokenize once, `pipelines/token_ids.py`)."""
        return dataclasses.replace(params, text_ids=self.text_ids) if self.text_ids else params


def check_prompt(ctx: ServerContext, texts: dict[str, str | None]) -> PromptCheck:
    """Count the texts ONCE through this process's prompt counter (`served_model`): texts longer than a text
    encoder takes become warnings for the response (logged once per request), or a 400 naming the field with
    --reject-truncated-prompts; the same count gives the usage text tokens. It tokenizes, so call it off the
    event loop (`count_prompt`), before the request is queued."""
    model = served_model(ctx)
    owner = model.prompt_tokens if model is not None else None
    counted = (owner or prompt_counter((), None)).count(texts)
    if not counted.truncations:
        return PromptCheck([], counted.text_tokens, counted.text_ids)
    if ctx.args.limits.reject_truncated_prompts:
        first = counted.truncations[0]
        raise InvalidRequestError(
            f"{first.message}; shorten it (this server runs with --reject-truncated-prompts).",
            param=first.field,
            code="prompt_too_long",
        )
    messages = [t.message for t in counted.truncations]
    logger.warning("request truncated by the text encoders: %s", "; ".join(messages))
    return PromptCheck(messages, counted.text_tokens, counted.text_ids)


async def count_prompt(ctx: ServerContext, texts: dict[str, str | None]) -> PromptCheck:
    """`check_prompt` in a worker thread: tokenizing never blocks the event loop."""
    return await run_in_threadpool(check_prompt, ctx, texts)


def result_timings(
    result: GenerationResult, *, encode_s: float, received: float, metrics: EngineMetrics | None = None
) -> dict[str, Any]:
    """The `timings` object of a response (milliseconds); with `metrics`, the request's serving overhead (its
    server time outside queue wait and pipeline calls) goes to `diffuserve_serving_overhead_seconds`."""
    total_s = time.monotonic() - received
    if metrics is not None:
        metrics.observe_serving_overhead(total_s - result.queue_wait_s - result.inference_s)
    return {
        "queue_wait_ms": round(result.queue_wait_s * 1000, 3),
        "inference_ms": round(result.inference_s * 1000, 3),
        "encode_ms": round(encode_s * 1000, 3),
        "total_ms": round(total_s * 1000, 3),
        "batch_size": result.batch_size,
        "batch_requests": result.batch_requests,
        "batch_rows": result.batch_rows,
        "pipeline_calls": result.pipeline_calls,
        "batch_tokens": result.batch_tokens,
        "stages_ms": {k: round(v * 1000, 3) for k, v in result.stage_seconds.items()},
        "step_cache": result.output.step_cache,
    }


def request_step_cache(body: Any, ctx: ServerContext) -> StepCacheSettings | None:
    """A body's step cache: its `step_cache` (or `enable_teacache: true`), else the server's `--step-cache`; magcache
    gets the checkpoint's ratios from `--step-cache-calibration`."""
    return with_calibration(_asked_step_cache(body, ctx), ctx.args.step_cache.calibration)


def _asked_step_cache(body: Any, ctx: ServerContext) -> StepCacheSettings | None:
    fields = body.model_fields_set
    if "enable_teacache" in fields and body.enable_teacache is not None:
        if "step_cache" in fields and body.step_cache is not None:
            raise InvalidRequestError("Give step_cache or enable_teacache, not both.", param="enable_teacache")
        return parse_step_cache("teacache" if body.enable_teacache else "off", "enable_teacache")
    if "step_cache" in fields:
        return parse_step_cache(body.step_cache if body.step_cache is not None else "off")
    return server_step_cache(ctx.args.step_cache.method, ctx.args.step_cache.options)
