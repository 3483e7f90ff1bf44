"""Step caches that decide per row: each output row computes or reuses a denoising step from its own history.

Peers decide per batch (one mean over the batch, one `.item()`), which makes a user's image depend on who it was
batched with. Here every row carries its own `RowCache` (its residuals, its Taylor factors, its counters), made
from its request's `StepCacheSettings` (`config/step_cache.py`), and the denoiser's blocks run only the rows
that compute at this step; the others reuse their own cached residual or forecast. The CFG branches of a row
decide together (the conditional branch measures, the negative one follows). Over several ranks (CFG, sequence
or tensor parallel, FSDP) the ranks agree on each measure before deciding (`rank_agreement`,
`parallel/agreement.py`), so they never diverge. Under torch.compile the hooks' own frames and the per-row
bookkeeping are not traced (`_eager`), only the blocks they call: rows switching between compute and reuse
recompile nothing.

How the denoiser is cut: the family spec's layer containers (the repeated blocks, `family_spec/*.py`) get named
diffusers `ModelHook`s (`HookRegistry`, as diffusers' own FirstBlockCache / TaylorSeer hooks), installed once
(`install_hooks`) and holding no state of a call: they read the rows of the call in progress, its `cache`
(`CallRows`, set by the recipe: `runtime/row_context.py`), and the first block hands the later ones its `Span`
through that call. The first block's hook decides and narrows the call to the computing rows; the later blocks
run on those rows only (their per-row arguments are indexed); the last block's hook rebuilds every row:
`base + residual`, the residual being the one just computed, the row's cached one, or its Taylor forecast. What
runs before and after the blocks (embedders, final norm and projection) runs for every row: it is cheap, and
keeps the call's shape.

Methods (settings in `config/step_cache.py`):
* `fbcache`: the first block runs for every row; a row reuses when the relative L1 change of its first-block
  residual, against its last computed step, is under the threshold (ParaAttention's First Block Cache).
* `teacache`: a row reuses while the accumulated change of its timestep-modulated input, rescaled by the
  published per-model polynomial, stays under the threshold (TeaCache; FLUX.1's coefficients).
* `magcache`: a row reuses while the error its skipped steps accumulate, predicted from the checkpoint's
  calibrated magnitude ratios (`diffuserve calibrate-cache`), stays under the threshold (MagCache; diffusers'
  calibration formula and `nearest_interp`).
* `taylorseer`: a row computes every `refresh_interval` steps and forecasts the blocks' residual between by a
  Taylor expansion in the step (diffusers' `TaylorSeerState` holds each row's factors).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.taylorseer_cache import TaylorSeerState

from diffuserve.family_spec import layer_rules, step_cache_rules
from diffuserve.family_spec.base import StepCacheRules
from diffuserve.runtime import row_context
from diffuserve.step_cache.packed import narrow_packed, real_lengths
from diffuserve.step_cache.rows import (
    CallRows,
    RankAgreement,
    RowCache,
    decide_fbcache,
    decide_magcache,
    decide_taylorseer,
    decide_teacache,
    new_row_caches,
    real_row,
    step_counts,
)

__all__ = [
    "CallRows",
    "RowCache",
    "install_hooks",
    "model_class",
    "new_row_caches",
    "rank_agreement",
    "step_counts",
    "supports_blocks",
]

HEAD_HOOK = "diffuserve_step_cache_head"
BLOCK_HOOK = "diffuserve_step_cache_block"

SHARED_ARGUMENT_WORDS = ("rotary", "rope")
"""Block arguments whose name holds one of these are shared by every row (position tables) and pass unchanged
(a packed call's, stacked per row, are cut with the rows: `step_cache/packed.py`); every other tensor argument with
one entry per row of the call (dim 0) is narrowed to the computing rows."""


def cache_rules(denoiser: torch.nn.Module) -> StepCacheRules:
    """How step caches cut `denoiser` beyond its layer containers: its family spec's `step_cache_rules`."""
    return step_cache_rules().get(model_class(denoiser).__name__, StepCacheRules())


# -- the call's rows and the span of blocks ------------------------------------------------------------------


@dataclass
class Span:
    """What the first block's hook hands the later blocks within one call."""

    call: CallRows
    index: torch.Tensor
    """Rows of the call that compute (ascending)."""
    full: int
    """Rows of the call."""
    base: tuple[torch.Tensor, torch.Tensor | None]
    """Hidden (and encoder) states of every row where the narrowed blocks start."""
    memo: dict[str, Any] = field(default_factory=dict)
    """A packed call's narrowed layout and masks, made once for all its blocks (`step_cache/packed.py`)."""


def install_hooks(denoiser: torch.nn.Module, containers: Sequence[str]) -> None:
    """Hook the blocks of `denoiser` a step cache narrows (`span_blocks`), once: a denoiser whose first block
    already holds the head hook is left as it is."""
    blocks = span_blocks(denoiser, containers)
    if len(blocks) < 2:
        raise ValueError("a step cache needs a denoiser with at least two repeated blocks")
    registry = HookRegistry.check_if_exists_or_initialize(blocks[0])
    if registry.get_hook(HEAD_HOOK) is not None:
        return
    rules = cache_rules(denoiser)
    metas = [_block_metadata(model_class(b)) for b in blocks]
    for position, block in enumerate(blocks):
        registry = HookRegistry.check_if_exists_or_initialize(block)
        hook: ModelHook = (
            _HeadHook(metas[0], rules)
            if position == 0
            else _BlockHook(metas[position], tail=position == len(blocks) - 1)
        )
        registry.register_hook(hook, HEAD_HOOK if position == 0 else BLOCK_HOOK)


@contextmanager
def caching(call: CallRows) -> Iterator[None]:
    """Within: the denoiser call made inside is `call`'s rows (the row context's `cache`)."""
    with row_context.with_parts(cache=call):
        yield


def _call_rows() -> CallRows | None:
    """The step-cache rows of the call in progress (None: no row caches, the hooks are the plain blocks)."""
    call = row_context.current()
    return None if call is None else call.cache


def model_class(module: torch.nn.Module) -> type:
    """The class the tables above (and the family specs) know `module` by: FSDP2's `fully_shard` swaps a module's
    class for a subclass named `FSDP<name>` (with `FSDPModule`), so its first other class in the MRO."""
    return next((c for c in type(module).__mro__ if not c.__name__.startswith("FSDP")), type(module))


def span_blocks(denoiser: torch.nn.Module, containers: Sequence[str]) -> list[torch.nn.Module]:
    """The blocks a step cache narrows: every container's when they chain (`StepCacheRules.chained`), else the
    last's."""
    if not cache_rules(denoiser).chained:
        containers = containers[-1:]
    return [block for name in containers for block in getattr(denoiser, name, ())]


def rank_agreement(split: Any, cfg_parallel: Any, rank_parts: Sequence[Any]) -> RankAgreement | None:
    """How the ranks that run a pipeline's rows agree on each row's measure (`parallel/agreement.py`): its
    sequence split while installed, its CFG parallel, the tensor-parallel / FSDP groups its weights were
    sharded over (each None or empty when not used). None in one process."""
    parts = [part for part in (split, cfg_parallel) if part is not None] + list(rank_parts)
    return RankAgreement(tuple(parts)) if parts else None


def block_containers(denoiser: torch.nn.Module) -> tuple[str, ...]:
    """Attribute names of `denoiser`'s repeated blocks: its class' layer containers in the family spec's layer table
    (`family_spec/*.py`)."""
    return tuple(path for path, _count in layer_rules().get(model_class(denoiser).__name__, ()))


def install_hooks_on(denoiser: torch.nn.Module) -> None:
    """`install_hooks` on `denoiser`'s layer containers (`block_containers`)."""
    install_hooks(denoiser, block_containers(denoiser))


def method_problem(denoisers: Sequence[torch.nn.Module], method: str) -> str | None:
    """Why step-cache `method` cannot run on a pipeline with `denoisers` (None: it can)."""
    for denoiser in denoisers:
        problem = supports_blocks(denoiser, block_containers(denoiser))
        if problem is not None:
            return problem
        if method == "teacache" and not cache_rules(denoiser).teacache_coefficients:
            return (
                f"teacache needs published rescale coefficients for {type(denoiser).__name__}; they exist for "
                f"{sorted(k for k, r in step_cache_rules().items() if r.teacache_coefficients)} (FLUX.1); use "
                "fbcache or taylorseer here"
            )
    return None


def supports_blocks(denoiser: torch.nn.Module, containers: Sequence[str]) -> str | None:
    """None when the step-cache hooks can cut `denoiser`; otherwise why not."""
    blocks = span_blocks(denoiser, containers)
    if len(blocks) < 2:
        return (
            f"a step cache narrows at least two repeated blocks; this {type(denoiser).__name__} has "
            f"{len(blocks)} in {list(containers)[-1:] or 'no declared layer container'}"
        )
    return None


@dataclass(frozen=True)
class _TensorBlock:
    """Metadata of a block diffusers has not registered: it must return its hidden states alone (SANA's)."""

    return_hidden_states_index: int = 0
    return_encoder_hidden_states_index: int | None = None
    unregistered: str = ""


def _block_metadata(cls: type) -> Any:
    """diffusers' block metadata (where the hidden and encoder states sit in the output), else `_TensorBlock`."""
    try:
        return TransformerBlockRegistry.get(cls)
    except ValueError:
        return _TensorBlock(unregistered=cls.__name__)


_eager = torch.compiler.disable
"""What torch.compile (`--enable-torch-compile`) must not trace: the per-row bookkeeping reads each row's Python
state (decided, compute, its residuals), so traced, every new pattern of rows would be a guard failure and a
recompile, until dynamo's recompile limit sends the frame back to eager."""
_around_blocks = torch.compiler.disable(recursive=False)
"""The hooks' own frames: run as Python, while the block's forward they call stays compiled (its own frame)."""


class _Block:
    """Argument access shared by the hooks (the diffusers block metadata says where outputs sit)."""

    def __init__(self, meta: Any) -> None:
        super().__init__()
        self.meta = meta
        self._signature: inspect.Signature | None = None

    @_eager
    def bind(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        if self._signature is None:
            self._signature = inspect.signature(self.fn_ref.original_forward)  # type: ignore[attr-defined]
        return self._signature.bind(*args, **kwargs)

    @_eager
    def states(self, bound: inspect.BoundArguments) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's hidden states (`hidden_states`, else its first argument: Z-Image's `x`) and encoder states."""
        hidden = bound.arguments.get("hidden_states")
        if hidden is None:
            hidden = next(iter(bound.arguments.values()))
        # The second stream the block returns: the text (encoder) states, or where a family's block metadata
        # names another (`second_stream`: LTX-2's audio tokens, families/ltx2/layout.py).
        return hidden, bound.arguments.get(getattr(self.meta, "second_stream", "encoder_hidden_states"))

    @_eager
    def outputs(self, out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(out, tuple):
            return out, None
        if getattr(self.meta, "unregistered", ""):
            raise TypeError(
                f"step cache: block {self.meta.unregistered} returns a tuple, but diffusers' "
                "TransformerBlockRegistry does not say where its hidden states are; register it"
            )
        enc = self.meta.return_encoder_hidden_states_index
        return out[self.meta.return_hidden_states_index], (None if enc is None else out[enc])

    @_eager
    def pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None, like: Any) -> Any:
        if not isinstance(like, tuple) or self.meta.return_encoder_hidden_states_index is None:
            return hidden
        out: list[Any] = [None, None]
        out[self.meta.return_hidden_states_index] = hidden
        out[self.meta.return_encoder_hidden_states_index] = encoder
        return tuple(out)

    @_around_blocks
    def run_rows(self, bound: inspect.BoundArguments, index: torch.Tensor, full: int) -> Any:
        """The block on rows `index` only: per-row arguments of `full` rows are narrowed (and per-row layers such
        as LoRA's follow them: `runtime/row_context.py`)."""
        if index.numel() == full:
            return self.fn_ref.original_forward(**bound.arguments)  # type: ignore[attr-defined]
        arguments = _narrow(bound, index, full, getattr(self.meta, "row_arguments", ()))
        call, packed = _call_rows(), contextlib.nullcontext()
        span = call.span if call is not None else None
        if span is not None and span.call.packed is not None:
            arguments, packed = narrow_packed(
                span.call.packed, arguments, index, full, span.memo, SHARED_ARGUMENT_WORDS
            )
        with row_context.narrowed(tuple(index.tolist()), full), packed:
            return self.fn_ref.original_forward(**arguments)  # type: ignore[attr-defined]


@_eager
def _narrow(
    bound: inspect.BoundArguments, index: torch.Tensor, full: int, rows: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A block's arguments for rows `index`: those with one entry per row of the call (`full`) are narrowed, and
    the tensors of `rows` (per-row position tables a block metadata names: LTX-2's RoPE (cos, sin) pairs)."""
    arguments = dict(bound.arguments)
    if index.numel() != full:
        for name in rows:
            value = arguments.get(name)
            if isinstance(value, tuple):
                arguments[name] = tuple(v.index_select(0, index.to(v.device)) for v in value)
        for name, value in arguments.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.shape[0] == full
                and not any(word in name for word in SHARED_ARGUMENT_WORDS)
            ):
                arguments[name] = value.index_select(0, index.to(value.device))
    return arguments


class _HeadHook(_Block, ModelHook):
    """First block: decides per row, then narrows the call to the rows that compute."""

    def __init__(self, meta: Any, rules: StepCacheRules) -> None:
        super().__init__(meta)
        self.rules = rules
        """The denoiser's step-cache rules (teacache's coefficients and input)."""

    @_around_blocks
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _call_rows()
        if call is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        bound = self.bind(module, args, kwargs)
        out = self.fn_ref.original_forward(*args, **kwargs) if call.method == "fbcache" else None
        output, run = self.decide(module, call, bound, out)
        return self.run_rows(bound, call.span.index, output) if run else output  # type: ignore[union-attr]

    @_eager
    def decide(self, module: torch.nn.Module, call: CallRows, bound: inspect.BoundArguments, out: Any) -> Any:
        """Every row of the call decides; the span records who computes. Returns (the block's output, False), or
        (the rows of the call, True) when the computing rows still have to run this block."""
        hidden, encoder = self.states(bound)
        full = hidden.shape[0]
        if call.packed is not None:  # padded rows: each measures and caches its real tokens only
            call.lengths = real_lengths(call.packed, bound.arguments, hidden)
        if call.method == "fbcache":
            first_hidden, first_encoder = self.outputs(out)
            decide_fbcache(call, first_hidden - hidden)
            base = (first_hidden, first_encoder)
        else:
            if call.method == "teacache":
                modulated = self.rules.teacache_input(module, hidden, bound.arguments)  # type: ignore[misc]
                decide_teacache(call, modulated, self.rules.teacache_coefficients)
            elif call.method == "magcache":
                decide_magcache(call)
            else:
                decide_taylorseer(call)
            base = (hidden, encoder)
        index = torch.tensor([i for i, row in enumerate(call.rows) if row.compute], dtype=torch.long)
        call.span = Span(call=call, index=index, full=full, base=base)
        if call.method == "fbcache":
            if index.numel() == full:
                return out, False
            return self.pack(
                base[0].index_select(0, index.to(hidden.device)),
                None if base[1] is None else base[1].index_select(0, index.to(hidden.device)),
                out,
            ), False
        if index.numel() == 0:
            return self.pack(hidden, encoder, (None, None)), False
        return full, True


class _BlockHook(_Block, ModelHook):
    """Later blocks: run the computing rows only; the last one rebuilds every row of the call."""

    def __init__(self, meta: Any, *, tail: bool) -> None:
        super().__init__(meta)
        self.tail = tail

    @_around_blocks
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _call_rows()
        span = call.span if call is not None else None
        if span is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        bound = self.bind(module, args, kwargs)
        if span.index.numel() == 0:  # every row reuses: nothing runs
            out = None
            hidden, encoder = self.states(bound)
        else:
            out = self.run_rows(bound, span.index, span.full)
            hidden, encoder = self.outputs(out)
        if not self.tail:
            return out if out is not None else self.pack(hidden, encoder, (None, None))
        hidden, encoder = _rebuild(span, hidden, encoder)
        call.span = None  # type: ignore[union-attr]
        return self.pack(hidden, encoder, out if out is not None else (None, None))


@_eager
def _rebuild(span: Span, hidden: torch.Tensor, encoder: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """Every row of the call after the blocks: a computed row leaves with its own output (bit-equal to an uncached
    step) and keeps its residual; the others get `base + residual`, their cached residual or their forecast."""
    base_hidden, base_encoder = span.base
    index = span.index.to(base_hidden.device)
    computed = span.index.tolist()
    keep_encoder = encoder is not None and base_encoder is not None
    if computed:
        res_hidden = hidden - base_hidden.index_select(0, index)
        res_encoder = encoder - base_encoder.index_select(0, index) if keep_encoder else None  # type: ignore[union-attr]
        for k, i in enumerate(computed):
            row, branch = span.call.rows[i], span.call.branches[i]
            if row.settings.calibrate and branch == 0:
                _record_ratio(row, real_row(span.call, res_hidden, i, k))
            res = (real_row(span.call, res_hidden, i, k), None if res_encoder is None else res_encoder[k])
            row.residual[branch] = res
            if row.settings.method == "taylorseer":
                state = row.taylor.setdefault(
                    branch, TaylorSeerState(taylor_factors_dtype=torch.float32, max_order=row.settings.order)
                )
                state.current_step = row.step
                state.update(res if res[1] is not None else (res[0],))
    if len(computed) == span.full:
        return hidden, encoder
    cached = [i for i in range(span.full) if i not in set(computed)]
    residuals = [_cached_residual(span.call.rows[i], span.call.branches[i]) for i in cached]
    where = torch.tensor(cached, device=base_hidden.device)
    out_hidden = base_hidden.clone()
    # A packed row cached its real tokens: zeros for its padding now (the call masks padding outputs away).
    tokens = base_hidden.shape[1]
    hidden_residuals = [r[0] if r[0].shape[0] == tokens else _zero_padded(r[0], tokens) for r in residuals]
    out_hidden.index_copy_(0, where, base_hidden.index_select(0, where) + torch.stack(hidden_residuals))
    if computed:
        out_hidden.index_copy_(0, index, hidden)
    out_encoder = base_encoder
    if base_encoder is not None:
        out_encoder = base_encoder.clone()
        if all(r[1] is not None for r in residuals):
            out_encoder.index_copy_(
                0, where, base_encoder.index_select(0, where) + torch.stack([r[1] for r in residuals])
            )  # type: ignore[misc]
        if computed and encoder is not None:
            out_encoder.index_copy_(0, index, encoder)
    return out_hidden, out_encoder


def _zero_padded(residual: torch.Tensor, tokens: int) -> torch.Tensor:
    return torch.cat([residual, residual.new_zeros(tokens - residual.shape[0], *residual.shape[1:])])


def _record_ratio(row: RowCache, residual: torch.Tensor) -> None:
    """Calibration: mean over tokens of |residual now| / |residual at the previous step| (diffusers' MagCache
    calibration formula; 1.0 for the first step)."""
    before = row.residual.get(0)
    if before is None:
        row.ratios.append(1.0)
        return
    now, then = torch.linalg.norm(residual.float(), dim=-1), torch.linalg.norm(before[0].float(), dim=-1)
    row.ratios.append(float((now / (then + 1e-8)).mean().item()))


def _cached_residual(row: RowCache, branch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A reusing row's residual: its last computed one, or (taylorseer) its forecast for this step."""
    if row.settings.method != "taylorseer":
        return row.residual[branch]
    state = row.taylor[branch]
    state.current_step = row.step
    forecast = state.predict()
    return forecast[0], (forecast[1] if len(forecast) > 1 else None)
