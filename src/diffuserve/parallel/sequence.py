"""Sequence parallel for the native DiTs: Ulysses, Ring, and their product (FLUX.1, Qwen-Image, Wan2.1/2.2,
HunyuanVideo 1.5, LTX-2).

Every rank of the sequence-parallel (SP) group gets the same batch and runs the same recipe; inside each
transformer call the image (or video) tokens are split over the group, each rank runs every block on its
share, and the output is all-gathered before the transformer returns, so the recipe around it sees the full
prediction on every rank, identical bytes on each (`RecipePipeline.run` is unchanged, and CFG parallel,
dynamic batching and the residency modes compose with it).

- The text tokens are not split: they are replicated on every rank (the text stream is small next to the
  image stream, and Wan's cross-attention then needs no communication at all). Joint attention sees
  `[text, local image tokens]` on each rank.
- Ulysses (`ulysses_group`, degree U): around each joint self-attention an all-to-all trades the sequence
  split for a head split (each rank then holds every image token for H/U heads; its text tokens it slices to
  the same heads locally), attention runs over the whole sequence in its original order, and a second
  all-to-all (image) plus an all-gather over heads (text) undo it. U must divide the attention heads.
- Ring (`ring_group`, degree R): the image keys/values travel around the ring (point-to-point, one hop per
  step); each step attends the local queries to one block with an op that also returns the log-sum-exp, and
  the partial results merge exactly in float32. Text keys join the local block only. Each rank computes its
  text queries itself, so the ranks' text streams may differ in the last bits; the gathered image output
  is the same bytes everywhere.
- Both: the token split is ring-major (shard `ring_rank * U + ulysses_rank`): the Ulysses all-to-all gathers
  each ring block (its peers' shares, H/U heads), then the ring runs over the blocks, as in USP.
- A token count that does not divide U x R is padded at the end; padded keys are dropped before attention
  and padded outputs before returning, so any size runs.
- Qwen-Image's text mask (a key-padding mask) is honoured in both modes.
- Packed mixed-size calls (`pipelines/packing.py`; FLUX.1, Qwen-Image): the padded sequence (every row's image
  tokens padded to the call's longest) is split like any other; the attention masks each row's padding as keys
  from the call's row context (the split's shares need not align to row boundaries), and the family cuts each
  row's RoPE table to this rank's share (`shard_tokens`). A ring block holding only a row's padding adds nothing
  to that row.
- LTX-2: the video tokens are split, the audio tokens replicated (`sequence_plans.py` says why); the
  video-to-audio cross-attention (audio queries, video keys) all-gathers the video keys' input and RoPE first.

The sharding is done by torch forward hooks named per DiT class below (where the tokens and their positional
tables appear, where the output is gathered, which attention modules are joint self-attention); attention
inside those modules goes through a wrapper of each diffusers module's `dispatch_attention_fn` that acts
only inside a sharded call, so every other model in the process runs unchanged. diffusers' own context
parallel (`enable_parallelism` + `_cp_plan`) was not used: it splits the text too (Qwen-Image's variable
text lengths would need its "anything" modes, which exclude Ulysses x Ring), builds its own device mesh, and
needs an accelerator on CPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from diffuserve.parallel.attention import block_attention, merge_partial
from diffuserve.parallel.sequence_plans import (
    check_sequence_parallel,
    plan_of,
)
from diffuserve.parallel.sequence_split import (
    SplitCall,
    attention_split,
    current_split,
    enter_attention,
    enter_split,
    leave_attention,
    leave_split,
)


def _wrap_dispatch(module_name: str) -> None:
    """Route `module_name`'s `dispatch_attention_fn` through the sequence-parallel attention inside sharded
    attention modules; everywhere else it calls diffusers' function unchanged. Idempotent."""
    import importlib

    module = importlib.import_module(module_name)
    original = module.dispatch_attention_fn
    if getattr(original, "_diffuserve_sp", False):
        return

    def dispatch_attention_fn(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        call = attention_split()
        if call is None:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, *args, **kwargs)
        if dropout_p or is_causal:
            raise ValueError("sequence-parallel attention supports neither dropout nor causal masks")
        call.sp.attention_calls += 1
        return call.sp.attention(call, query, key, value, attn_mask, scale)

    dispatch_attention_fn._diffuserve_sp = True  # type: ignore[attr-defined]
    module.dispatch_attention_fn = dispatch_attention_fn


# -- attention inputs ------------------------------------------------------------------------------------


def _key_padding(attn_mask: torch.Tensor | None, text: int) -> torch.Tensor | None:
    """The text part (B, text) of a joint key-padding mask (B, 1, 1, keys), or None when nothing is masked. The
    image part is all True by construction (Qwen-Image's processor appends ones), and is not read (no host sync)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool and attn_mask.ndim == 2:  # (B, keys): a packed call's key mask (FLUX.1)
        return attn_mask[:, :text]
    if attn_mask.dtype != torch.bool or attn_mask.ndim != 4 or attn_mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"sequence-parallel attention takes a boolean key-padding mask (B, 1, 1, keys) or (B, keys); got "
            f"{attn_mask.dtype} {tuple(attn_mask.shape)}"
        )
    return attn_mask[:, 0, 0, :text]


def _image_padding(call: SplitCall, batch: int, device: torch.device) -> torch.Tensor | None:
    """In a packed call: (batch, padded) bool, True at each row's real image tokens (False at its own padding and at
    the split's); None otherwise. Read from the call's row context, not from the mask the family passes, whose image
    part is laid out for the whole sequence while the attention sees this rank's share."""
    from diffuserve.pipelines.packing import active_rows

    rows = active_rows()
    if rows is None:
        return None
    if rows.max_image != call.tokens:
        raise ValueError(f"packed call of {rows.max_image} image tokens per row split as {call.tokens} tokens")
    mask = rows.image_mask(max(batch // rows.rows, 1), device)
    return torch.cat([mask, mask.new_zeros(batch, call.padded - call.tokens)], dim=1)


def _joint_mask(text_mask: torch.Tensor | None, image_mask: torch.Tensor | None, text: int, image: int) -> Any:
    """(B, text + image) key mask of [text, image] keys from their parts (None: all attend), or None."""
    if text_mask is None and image_mask is None:
        return None
    reference = text_mask if text_mask is not None else image_mask
    assert reference is not None
    if text_mask is None:
        text_mask = reference.new_ones(reference.shape[0], text)
    if image_mask is None:
        image_mask = reference.new_ones(reference.shape[0], image)
    return torch.cat([text_mask, image_mask], dim=1)


# -- the strategy -------------------------------------------------------------------------------------------


@dataclass
class SequenceParallel:
    """Ulysses x Ring sequence parallel attached to a native pipeline (`enable_sequence_parallel`)."""

    ulysses_group: Any = None
    """Process group of this rank's Ulysses peers (None: Ulysses degree 1)."""
    ring_group: Any = None
    """Process group of this rank's Ring peers (None: Ring degree 1)."""
    handles: list[Any] = field(default_factory=list)
    """The hooks installed (removed by `remove`)."""
    calls: int = 0
    """Sharded transformer calls so far."""
    attention_calls: int = 0
    """Sharded attention calls so far (every joint self-attention of those calls)."""

    def __post_init__(self) -> None:
        self.ulysses_degree = 1 if self.ulysses_group is None else dist.get_world_size(self.ulysses_group)
        self.ring_degree = 1 if self.ring_group is None else dist.get_world_size(self.ring_group)
        self.ulysses_rank = 0 if self.ulysses_group is None else dist.get_rank(self.ulysses_group)
        self.ring_rank = 0 if self.ring_group is None else dist.get_rank(self.ring_group)
        self.degree = self.ulysses_degree * self.ring_degree
        """Ranks the tokens are split over (`--sp-degree`)."""
        self.index = self.ring_rank * self.ulysses_degree + self.ulysses_rank
        """This rank's share of the tokens (ring-major, so each ring block is its Ulysses peers' shares)."""

    def describe(self) -> dict[str, int]:
        return {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree}

    # -- hooks ---------------------------------------------------------------------------------------------

    def install(self, transformer: torch.nn.Module) -> None:
        """Hook one DiT (its class must have a plan)."""
        plan = plan_of(transformer)
        assert plan is not None
        _wrap_dispatch(plan.module)
        sp = self
        signature = _parameters(transformer)

        def enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            named = {**dict(zip(signature, args, strict=False)), **kwargs}
            tokens = plan.tokens(module, named)
            sp.calls += 1
            enter_split(SplitCall(sp, tokens, -(-tokens // sp.degree)))
            return args, kwargs

        def leave(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            leave_split()

        self.handles.append(transformer.register_forward_pre_hook(enter, with_kwargs=True))
        for path, name, dim, ndim in plan.inputs:
            target = transformer.get_submodule(path) if path else transformer
            self.handles.append(
                target.register_forward_pre_hook(_split_argument(target, name, dim, ndim), with_kwargs=True)
            )
        for path, indices, dim in plan.outputs:
            self.handles.append(transformer.get_submodule(path).register_forward_hook(_split_output(indices, dim)))
        self.handles.append(transformer.get_submodule(plan.gather).register_forward_hook(_gather_output))
        for blocks, attribute in plan.attention:
            for block in transformer.get_submodule(blocks):
                attention = getattr(block, attribute)
                self.handles.append(attention.register_forward_pre_hook(enter_attention))
                self.handles.append(attention.register_forward_hook(leave_attention, always_call=True))
        for blocks, attribute, names in plan.gathered_keys:
            for block in transformer.get_submodule(blocks):
                hook = _gather_arguments(names)
                self.handles.append(getattr(block, attribute).register_forward_pre_hook(hook, with_kwargs=True))
        # always_call: the call's state is cleared even when the forward raises.
        self.handles.append(transformer.register_forward_hook(leave, with_kwargs=True, always_call=True))

    def shard_tokens(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Within a sharded call: this rank's share of `x`'s image tokens on `dim` (zero-padded as the hidden states
        are); outside one, `x`. A packed call's per-row RoPE table is cut with it (`families/*/ops.py`)."""
        call = current_split()
        return x if call is None else call.shard(x, dim)

    def real_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Step caches: `x` cut to this rank's real tokens, and their share of the row's (`parallel/agreement.py`)."""
        from diffuserve.parallel.agreement import real_tokens

        return real_tokens(self, current_split(), x)

    def agree_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Step caches: each row's share-weighted measures summed over the split (`parallel/agreement.py`)."""
        from diffuserve.parallel.agreement import sum_over_split

        return sum_over_split(self, values)

    def remove(self) -> None:
        """Take every hook off (the pipeline runs single-process again)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- attention -------------------------------------------------------------------------------------------

    def attention(
        self,
        call: SplitCall,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        """Joint self-attention of `[text, local image tokens]` (B, L, H, D) over every rank's image tokens."""
        text = query.shape[1] - call.local
        if key.shape[1] != query.shape[1] or text < 0:
            raise ValueError(
                f"sequence-parallel attention expects joint self-attention over [text, {call.local} "
                f"local tokens]; got queries {tuple(query.shape)}, keys {tuple(key.shape)}"
            )
        masks = (_key_padding(attn_mask, text), _image_padding(call, query.shape[0], query.device))
        if self.ulysses_degree > 1:
            query, key, value = (self._to_heads(x, text) for x in (query, key, value))
        if self.ring_degree > 1:
            out = self._ring(call, query, key, value, text, masks, scale)
        else:
            out = self._whole(call, query, key, value, text, masks, scale)
        return self._to_sequence(out, text) if self.ulysses_degree > 1 else out

    def _to_heads(self, x: torch.Tensor, text: int) -> torch.Tensor:
        """(B, text + local, H, D) -> (B, text + U*local, H/U, D): every Ulysses peer's tokens, this rank's heads."""
        batch, _, heads, dim = x.shape
        u, h = self.ulysses_degree, heads // self.ulysses_degree
        image = x[:, text:].reshape(batch, -1, u, h, dim).permute(2, 1, 0, 3, 4).contiguous()
        received = torch.empty_like(image)
        dist.all_to_all_single(received, image, group=self.ulysses_group)
        image = received.permute(2, 0, 1, 3, 4).reshape(batch, -1, h, dim)
        mine = x[:, :text, self.ulysses_rank * h : (self.ulysses_rank + 1) * h]
        return torch.cat([mine, image], dim=1)

    def _to_sequence(self, x: torch.Tensor, text: int) -> torch.Tensor:
        """The inverse of `_to_heads`: (B, text + U*local, H/U, D) -> (B, text + local, H, D)."""
        batch, _, h, dim = x.shape
        u = self.ulysses_degree
        image = x[:, text:].reshape(batch, u, -1, h, dim).permute(1, 0, 2, 3, 4).contiguous()
        received = torch.empty_like(image)
        dist.all_to_all_single(received, image, group=self.ulysses_group)
        image = received.permute(1, 2, 0, 3, 4).reshape(batch, -1, u * h, dim)
        if not text:
            return image
        parts = [torch.empty_like(x[:, :text]) for _ in range(u)]
        dist.all_gather(parts, x[:, :text].contiguous(), group=self.ulysses_group)
        return torch.cat([torch.cat(parts, dim=2), image], dim=1)

    def _block_tokens(self, call: SplitCall, ring_rank: int) -> int:
        """Real (unpadded) image tokens in ring rank `ring_rank`'s block."""
        size = call.local * self.ulysses_degree
        return max(0, min(size, call.tokens - ring_rank * size))

    def _whole(
        self,
        call: SplitCall,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        text: int,
        masks: tuple[torch.Tensor | None, torch.Tensor | None],
        scale: float | None,
    ) -> torch.Tensor:
        # Ulysses alone: every image token is here (for this rank's heads), in the original order; one attention
        # call over the unpadded keys, as diffusers' native backend makes it.
        # `masks`: the text's key padding and a packed call's image padding (either may be None).
        keys = text + call.tokens
        text_mask, image_mask = masks
        mask = _joint_mask(text_mask, None if image_mask is None else image_mask[:, : call.tokens], text, call.tokens)
        if mask is not None:
            mask = mask[:, None, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k[:, :keys].transpose(1, 2), v[:, :keys].transpose(1, 2), attn_mask=mask, scale=scale
        )
        return out.transpose(1, 2)

    def _ring(
        self,
        call: SplitCall,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        text: int,
        masks: tuple[torch.Tensor | None, torch.Tensor | None],
        scale: float | None,
    ) -> torch.Tensor:
        r, n = self.ring_rank, self.ring_degree
        text_mask, image_mask = masks
        size = call.local * self.ulysses_degree  # image tokens per ring block
        queries = q.transpose(1, 2)
        block = torch.stack([k[:, text:], v[:, text:]]).contiguous()  # this rank's image keys/values, travelling
        send_to = dist.get_global_rank(self.ring_group, (r + 1) % n)
        receive_from = dist.get_global_rank(self.ring_group, (r - 1) % n)
        out = lse = None
        for step in range(n):
            owner = (r - step) % n
            pending = []
            if step < n - 1:
                incoming = torch.empty_like(block)
                pending = dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, block, send_to, self.ring_group),
                        dist.P2POp(dist.irecv, incoming, receive_from, self.ring_group),
                    ]
                )
            real = self._block_tokens(call, owner)
            image = None if image_mask is None else image_mask[:, owner * size : owner * size + real]
            if step == 0:  # the local block carries the text keys (once over the ring)
                keys, values = k[:, : text + real], v[:, : text + real]
                mask = _joint_mask(text_mask, image, text, real)
            else:
                keys, values, mask = block[0][:, :real], block[1][:, :real], image
            if keys.shape[1]:
                part, part_lse = block_attention(queries, keys.transpose(1, 2), values.transpose(1, 2), mask, scale)
                out, lse = merge_partial(out, lse, part, part_lse)
            for request in pending:
                request.wait()
            if step < n - 1:
                block = incoming
        assert out is not None, "every ring has real keys"
        return out.to(q.dtype).transpose(1, 2)


# -- hook bodies (they act only inside a sharded call) --------------------------------------------------------


def _parameters(module: torch.nn.Module) -> list[str]:
    """Argument names of the class's forward (not the instance's: offload hooks replace it by a `*args` wrapper)."""
    return list(inspect.signature(type(module).forward).parameters)[1:]


def _split_argument(module: torch.nn.Module, name: str, dim: int, ndim: int) -> Callable:
    position = _parameters(module).index(name)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        call = current_split()
        if call is None:
            return args, kwargs
        if name in kwargs:
            if isinstance(kwargs[name], torch.Tensor) and kwargs[name].ndim == ndim:
                kwargs = {**kwargs, name: call.shard(kwargs[name], dim)}
        elif position < len(args) and isinstance(args[position], torch.Tensor) and args[position].ndim == ndim:
            args = (*args[:position], call.shard(args[position], dim), *args[position + 1 :])
        return args, kwargs

    return hook


def _split_output(indices: tuple[int, ...], dim: int) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        call = current_split()
        if call is None:
            return output
        return tuple(call.shard(x, dim) if i in indices else x for i, x in enumerate(output))

    return hook


def _gather_arguments(names: tuple[str, ...]) -> Callable:
    """All-gather the keyword arguments `names` (tensors with the split tokens on dim 1, or RoPE tuples) on entry."""

    def gather(call: SplitCall, x: Any) -> Any:
        if isinstance(x, tuple):
            return tuple(gather(call, part) for part in x)
        if not isinstance(x, torch.Tensor):
            return x
        return call.gather_on(x, 2 if x.ndim == 4 else 1)  # split RoPE tables are (batch, heads, tokens, D)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        call = current_split()
        if call is None:
            return args, kwargs
        return args, {**kwargs, **{n: gather(call, kwargs[n]) for n in names if kwargs.get(n) is not None}}

    return hook


def _gather_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    call = current_split()
    return output if call is None else call.gather(output)


# -- the entry point ------------------------------------------------------------------------------------------


def enable_sequence_parallel(pipeline: Any, *, ulysses_group: Any = None, ring_group: Any = None) -> SequenceParallel:
    """Split every denoiser call of a native pipeline over `ulysses_group` x `ring_group` (None: degree 1).

    Every rank of both groups must run the same batches. Refuses with ConfigError (param `ulysses_degree` or
    `ring_degree`) a pipeline without a sequence split or a Ulysses degree that does not divide the heads."""
    if pipeline.active_split() is not None:
        raise ValueError("sequence parallel is already enabled on this pipeline; call its remove() first")
    sp = SequenceParallel(ulysses_group, ring_group)
    check_sequence_parallel(pipeline, ulysses_degree=sp.ulysses_degree, ring_degree=sp.ring_degree)
    if sp.degree > 1:
        for key in pipeline.denoisers:
            if key in pipeline.components:
                sp.install(pipeline.components[key])
    pipeline.sequence_parallel = sp  # a declared field of every pipeline (`Pipeline.sequence_parallel`)
    return sp
