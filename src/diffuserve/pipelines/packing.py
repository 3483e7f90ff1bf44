"""Packed mixed-size denoiser calls: rows of different sizes (and text lengths) share ONE denoiser call.

Layout: each row keeps its own batch index; its text tokens and latent tokens are padded to the call's longest
(`PackedRows`), the padding is masked out of every attention (a key mask: block-diagonal per row by construction),
and each row gets its own position ids (RoPE). Chosen over one batch-1 sequence because everything outside
attention is already per row along dim 0 in diffusers' blocks: the timestep / guidance embedding and the adaLN
modulation broadcast `(rows, dim)` vectors over each row's tokens, and LoRA's per-row slots, the CFG doubling and
the step-cache narrowing index rows on dim 0, so they compose unchanged, where a batch-1 sequence would need a
per-token modulation hook in every block. Equality: a row's real tokens attend to exactly its own real tokens with
its own positions and modulation, as alone. Cost: the padding (`padding_tokens`) runs the linear layers for nothing;
attention skips it with a variable-length kernel (`flex_attention` with a block mask, chosen by device in
`packed_kernel`) and computes-then-masks it with SDPA's key mask on CPU.

The recipe side (`packing_run.run_mixed`): requests are grouped by size (stable, first-seen order), each size group
prepares its own latents, schedule and scheduler (dynamic shift depends on the token count), the groups' latents are
padded into one tensor, one call per step predicts every row, and `PackedScheduler` steps each group with its own
scheduler. Decode runs per size group. Compositions not yet proven packed (`packing_problem`) run the size groups
as separate recipe runs instead, one after the other, and say so once in the log. Where a packed call's padding
would cost more than the calls it saves (the opt-in cost gate, `pack_plan.py`), the sizes run as several calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diffuserve.pipelines.batch_rows import Denoised, DenoiseState, StageTimer, check_batch
from diffuserve.runtime import row_context

if TYPE_CHECKING:
    from diffuserve.pipelines.results import BatchResult
    from diffuserve.sampling import SamplingParams

RecipePipeline = Any
"""A `recipe.RecipePipeline` (named, not imported: the recipe imports this module)."""

logger = logging.getLogger(__name__)

PACKED_ROW_EXTRAS = ("velocity",)
"""Extras a family's scheduler step leaves on the packed state, laid out like the latents (FLUX.1's velocity for the
clean-latent preview): cut to each size group before its preview."""


@dataclass(frozen=True)
class PackedRows:
    """The row context of one packed call (DESIGN §8): each row's token spans in the padded layout."""

    text_tokens: tuple[int, ...]
    """Real text tokens of each row (a row of the call, CFG halves not doubled)."""
    image_tokens: tuple[int, ...]
    """Real latent tokens of each row."""
    max_text: int
    """The call's text span (every row's text padded to it)."""
    max_image: int
    """The call's latent span (every row's latents padded to it)."""
    text_first: bool = True
    """The joint sequence is [text, image] (FLUX.1, Qwen-Image); False: [image, text] (SD3)."""
    kernel: str = "sdpa"
    """`sdpa` (a key mask), `flex` (`flex_attention` with a block mask that skips padded blocks) or `split` (sequence
    parallel, whose attention masks the padding from this context: the key mask only reaches it, no SDPA wrap)."""

    @property
    def rows(self) -> int:
        return len(self.image_tokens)

    @property
    def padding_tokens(self) -> int:
        """Tokens of the call that belong to no row (the cost of packing)."""
        real = sum(self.text_tokens) + sum(self.image_tokens)
        return self.rows * (self.max_text + self.max_image) - real

    def key_mask(self, repeats: int, device: torch.device | str, keys: int | None = None) -> torch.Tensor:
        """(rows x repeats, keys) bool: False at a row's latent padding (`repeats` = 2 for a doubled CFG batch, whose
        halves are the same rows). The text span (`keys - max_image`, default `max_text`) is all True here: a family
        whose text is padded masks it itself, per branch (Qwen-Image's processor, from the text mask)."""
        text = self.max_text if keys is None else keys - self.max_image
        parts = [
            torch.ones(self.rows * repeats, text, dtype=torch.bool, device=device),
            self.image_mask(repeats, device),
        ]
        return torch.cat(parts if self.text_first else parts[::-1], dim=1)

    def image_mask(self, repeats: int, device: torch.device | str) -> torch.Tensor:
        """(rows x repeats, max_image) bool: the real latent tokens."""
        index = torch.arange(self.max_image, device=device)[None]
        return (index < torch.tensor(self.image_tokens, device=device)[:, None]).repeat(repeats, 1)

    def sdpa_mask(self, batch: int, keys: int, device: torch.device | str) -> torch.Tensor | None:
        """The (batch, 1, 1, keys) mask of an attention over `keys` keys (text and latents, or the latents alone as in
        SD3.5's second attention) in this call; None for an attention shorter than the latents."""
        if keys < self.max_image or self.kernel == "split":
            return None
        return self.key_mask(max(batch // self.rows, 1), device, keys)[:, None, None, :]

    def attention_mask(self, repeats: int, device: torch.device | str) -> Any:
        """What the attention processors take as `attention_mask`: the key mask, or flex's block mask."""
        mask = self.key_mask(repeats, device)
        if self.kernel != "flex":
            return mask
        from torch.nn.attention.flex_attention import create_block_mask

        def keep(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return mask[b, kv] & mask[b, q]

        length = mask.shape[1]
        return create_block_mask(keep, mask.shape[0], None, length, length, device=mask.device)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: this call's rows are packed (the rotary hook and the attention backend read it)."""
        with row_context.with_parts(packed=self):
            if self.kernel == "flex":
                from diffusers.models.attention_dispatch import attention_backend

                if torch.cuda.is_available():
                    _fused_flex()
                with attention_backend("flex"):
                    yield
            else:
                yield


@torch.compiler.disable
def active_rows() -> PackedRows | None:
    """The packed rows of the call running now (the row context's `packed`), or None. Read outside compiled code
    (`torch.compiler.disable`: a graph break at the attention wrappers below and sequence parallel's attention), so
    the masks' Python bookkeeping is never traced."""
    call = row_context.current()
    return None if call is None else call.packed


def packed_kernel(device: torch.device | str, split: bool = False) -> str:
    """The attention kernel of packed calls: `split` under sequence parallel (its attention masks the padding), `flex`
    on CUDA (flex_attention skips padded blocks), else `sdpa` (a key mask: the padding computed, then masked)."""
    if split:
        return "split"
    if torch.device(device).type == "cuda":
        with contextlib.suppress(ImportError):
            from torch.nn.attention import flex_attention  # noqa: F401

            return "flex"
    return "sdpa"


def _fused_flex() -> None:
    """diffusers' flex backend calls `flex_attention` eagerly: torch's unfused reference, which materialises the
    scores. The fused kernel is the compiled function, so diffusers' dispatch module gets (once) a view of torch's
    flex module whose `flex_attention` is compiled; nothing else in the process uses that backend."""
    from diffusers.models import attention_dispatch as dispatch
    from torch.nn.attention import flex_attention as module

    if getattr(dispatch.flex_attention, "diffuserve_fused", False):
        return
    view = types.SimpleNamespace(**{name: getattr(module, name) for name in dir(module) if not name.startswith("__")})
    view.flex_attention = torch.compile(module.flex_attention, dynamic=False)
    view.diffuserve_fused = True
    dispatch.flex_attention = view


class _MaskedFunctional(types.ModuleType):
    """`torch.nn.functional` as a diffusers module sees it once `install_masked_sdpa` ran: within a packed call,
    `scaled_dot_product_attention` without a mask gets the call's key mask; everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        rows = active_rows()
        if rows is not None and not args and kwargs.get("attn_mask") is None:
            kwargs["attn_mask"] = rows.sdpa_mask(query.shape[0], key.shape[-2], key.device)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, *args, **kwargs)


def install_masked_sdpa(module_name: str) -> None:
    """Padding masks for a diffusers module whose processors call `F.scaled_dot_product_attention` without a mask
    (SD3's `JointAttnProcessor2_0`): its `F` becomes `_MaskedFunctional` (once); outside a packed call, unchanged."""
    import importlib

    module = importlib.import_module(module_name)
    if not isinstance(module.F, _MaskedFunctional):
        module.F = _MaskedFunctional("torch.nn.functional")


def install_row_rotary(module_name: str, name: str = "apply_rotary_emb") -> None:
    """Per-row RoPE for a diffusers transformer module whose processors rotate (rows, tokens, heads, dim) queries
    and keys with `name(x, table, ...)` and ONE (tokens, dim) table for the whole batch: within a packed call the
    family passes the rows' tables stacked (rows x tokens, dim), and the rows are rotated as one flattened sequence
    (diffusers' own formula, per token). Wrapped once per module; outside a packed call it is diffusers' function."""
    import importlib

    module = importlib.import_module(module_name)
    original = getattr(module, name)
    if getattr(original, "diffuserve_rows", False):
        return

    def rotate(x: torch.Tensor, freqs_cis: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        table = freqs_cis[0] if isinstance(freqs_cis, tuple) else freqs_cis
        # Decided by shapes alone (a stacked per-row table has rows x tokens entries, diffusers' one table
        # `tokens`), never by the call's packed rows (`active_rows`): reading them inside a compiled block breaks the
        # graph, and the wrap stays installed for every later (compiled) call of the process.
        if x.shape[0] > 1 and table.shape[0] == x.shape[0] * x.shape[1]:
            return original(x.reshape(1, -1, *x.shape[2:]), freqs_cis, *args, **kwargs).reshape(x.shape)
        return original(x, freqs_cis, *args, **kwargs)

    rotate.diffuserve_rows = True  # type: ignore[attr-defined]
    setattr(module, name, rotate)


def install_masked_dispatch(module_name: str) -> None:
    """Padding masks for a diffusers module whose processors build their own mask (Qwen-Image's text padding) and
    call `dispatch_attention_fn`: within a packed call the call's key mask is ANDed in (the image padding too).
    Wrapped once per module (beside sequence parallel's wrap, which passes masks through)."""
    import importlib

    module = importlib.import_module(module_name)
    original = module.dispatch_attention_fn
    if getattr(original, "diffuserve_rows", False):
        return

    def dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rows = active_rows()
        if rows is not None and not args:
            mask = rows.sdpa_mask(query.shape[0], key.shape[1], key.device)
            given = kwargs.get("attn_mask")
            if mask is not None:
                kwargs["attn_mask"] = mask if given is None else (given.bool() & mask)
        return original(query, key, value, *args, **kwargs)

    dispatch.diffuserve_rows = True  # type: ignore[attr-defined]
    module.dispatch_attention_fn = dispatch


def packing_problem(
    head: SamplingParams, rows: Sequence[SamplingParams] = (), *, split: bool = False, packs_split: bool = False
) -> str | None:
    """Why a mixed-size batch with `head`'s settings (and the per-row fields of `rows`, the batch's requests) cannot
    run packed (its size groups then run as separate calls), or None: the compositions not yet proven equal to their
    singletons packed. `split`: a sequence split is installed; `packs_split`: the family's packed call cuts its
    per-row positions to a rank's share (`AdapterBase.packs_split`)."""
    if any(p.image_inputs or p.mask_input is not None for p in (head, *rows)):
        return "image-conditioned requests (edits, references, masks) are not yet proven packed"
    if any(p.control is not None for p in (head, *rows)):
        return "ControlNet rows are not yet proven packed (their residuals are laid out per size)"
    if split and not packs_split:
        return "this family's packed call does not yet cut its per-row positions to a rank's share"
    if split and head.step_cache_method != "off":
        # The ranks' step-cache agreement (parallel/agreement.py) would count packed rows' padding as tokens.
        return "step caches under sequence parallel are not yet proven on packed rows"
    return None


# -- the recipe side --------------------------------------------------------------------------------------------


@dataclass
class SizeGroup:
    """The rows of one size in a packed batch."""

    batch: list[SamplingParams]
    """Its requests, in the packed call's order."""
    rows: slice
    """Its rows in the packed call."""
    state: DenoiseState
    """Its own latents (token form), schedule, scheduler and extras, as `prepare` made them."""
    spatial: tuple[int, ...] | None = None
    """(channels, height, width) of a family whose latents are images (SD3): held as (rows, h x w, channels)
    tokens here (the flow-matching step is elementwise), given back in that shape to decode and previews."""

    def latents_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """This group's rows of `tokens` (cut to its length) in the family's own latent shape."""
        tokens = tokens[:, : self.tokens]
        if self.spatial is None:
            return tokens
        return tokens.transpose(1, 2).reshape(tokens.shape[0], *self.spatial)

    @property
    def tokens(self) -> int:
        return int(self.state.latents.shape[1])


@dataclass
class Packed:
    """`state.extras["packed"]` of a packed batch: its size groups and its requests' original order."""

    groups: list[SizeGroup]
    """Its size groups, in the packed call's row order."""
    layout: PackedRows
    """The call's row context (token spans, kernel)."""
    order: list[int]
    """order[k] = the index, in the batch as given, of the k-th request of the packed call."""
    extras: dict[str, Any] = field(default_factory=dict)
    """`parts`: the size groups' own runs, when `packing_problem` sent them through the recipe one by one."""


def mixed_sizes(batch: Sequence[SamplingParams]) -> bool:
    """Whether the batch's requests ask for more than one output size."""
    return len({(p.width, p.height) for p in batch}) > 1


def size_order(batch: Sequence[SamplingParams]) -> list[int]:
    """Request indices grouped by size, the sizes in first-seen order, requests in their order within a size."""
    sizes = list(dict.fromkeys((p.width, p.height) for p in batch))
    return sorted(range(len(batch)), key=lambda i: sizes.index((batch[i].width, batch[i].height)))


def check_mixed(batch: Sequence[SamplingParams]) -> SamplingParams:
    """The head, after checking every request shares its signature but for the size."""
    head = batch[0]
    check_batch([dataclasses.replace(p, width=head.width, height=head.height) for p in batch])
    return head


def pad_tokens(parts: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """(rows_g, tokens_g, channels) parts -> (rows, length, channels), zeros after each row's tokens."""
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, length - p.shape[1])) for p in parts])


class PackedScheduler:
    """Steps each size group's rows with that group's own scheduler (its own sigmas)."""

    def __init__(self, groups: list[SizeGroup], length: int) -> None:
        self.groups = groups
        self.length = length

    def step(self, pred: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, return_dict: bool = False) -> tuple:
        parts = []
        for g in self.groups:
            n = g.tokens
            row_t = t[g.rows.start] if t.ndim else t
            parts.append(g.state.scheduler.step(pred[g.rows, :n], row_t, latents[g.rows, :n], return_dict=False)[0])
        return (pad_tokens(parts, self.length),)


def _sum_seconds(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for part in parts:
        for stage, value in part.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
    return seconds


def _group_images(pipe: RecipePipeline, latents: torch.Tensor, state: DenoiseState, preview: bool) -> list[Any]:
    packed: Packed = state.extras["packed"]
    images: list[Any] = []
    for g in packed.groups:
        for key in PACKED_ROW_EXTRAS:
            if isinstance(state.extras.get(key), torch.Tensor):
                g.state.extras[key] = g.latents_of(state.extras[key][g.rows])
        part = g.latents_of(latents[g.rows])
        images.extend(pipe.preview(part, g.state) if preview else pipe.decode(part, g.state))
    return images


def previews(pipe: RecipePipeline, latents: torch.Tensor, state: DenoiseState) -> list[Any]:
    """A preview per row of a packed batch (in the packed call's row order), each size group on its own."""
    return _group_images(pipe, latents, state, preview=True)


def decode_batch(pipe: RecipePipeline, denoised: Denoised) -> BatchResult:
    """Stage 4 of a mixed-size batch: decode per size group, then the outputs back in the batch's request order."""
    from diffuserve.pipelines.batch_rows import rows_per_request
    from diffuserve.pipelines.results import BatchResult

    packed: Packed = denoised.state.extras["packed"]
    if "parts" in packed.extras:
        results = [pipe.decode_batch(part) for part in packed.extras["parts"]]
        outputs = [out for result in results for out in result.outputs]
        seconds = _sum_seconds([result.stage_seconds for result in results])
    else:
        timer = StageTimer()
        timer.seconds = dict(denoised.stage_seconds)
        with torch.inference_mode(), timer.stage("decode"), pipe.decoder_scope():
            images = _group_images(pipe, denoised.latents, denoised.state, preview=False)
        outputs = pipe.outputs_of(rows_per_request(images, denoised.batch), denoised)
        seconds = timer.seconds
    restored: list[Any] = [None] * len(outputs)
    for k, index in enumerate(packed.order):
        restored[index] = outputs[k]
    return BatchResult(outputs=restored, stage_seconds=seconds)
