"""The tensor-parallel plans of the DiTs diffusers has none for (Wan, HunyuanVideo 1.5, LTX-2), and what each needs
besides its Linears cut: the attention modules' local head counts, q/k RMSNorms across heads computed from the whole
vector (`ShardedRMSNorm`), and LTX-2's RoPE tables cut to the rank's features. Read by `parallel/tensor.py`.

Every column split is contiguous in rank order (DTensor's `Shard(0)` of the weight), so rank r holds heads
[r * h / degree, (r + 1) * h / degree) of every attention, and whatever is laid out along those features (a norm's
weight, a RoPE table, a per-head gate) is cut to the same slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

WAN_TP_PLAN = {
    "blocks.*.attn1.to_q": "colwise",
    "blocks.*.attn1.to_k": "colwise",
    "blocks.*.attn1.to_v": "colwise",
    "blocks.*.attn1.to_out.0": "rowwise",
    "blocks.*.attn2.to_q": "colwise",
    "blocks.*.attn2.to_k": "colwise",
    "blocks.*.attn2.to_v": "colwise",
    "blocks.*.attn2.to_out.0": "rowwise",
    "blocks.*.ffn.net.0.proj": "colwise",
    "blocks.*.ffn.net.2": "rowwise",
}
"""WanTransformer3DModel's plan (diffusers 0.42 has none): self- and cross-attention, then the MLP."""

WAN_I2V_TP_PLAN = {
    "blocks.*.attn2.add_k_proj": "colwise",
    "blocks.*.attn2.add_v_proj": "colwise",
}
"""Added to `WAN_TP_PLAN` when the cross-attention also reads image tokens (Wan I2V: `added_kv_proj_dim`)."""

HUNYUAN_VIDEO_15_TP_PLAN = {
    **{f"transformer_blocks.*.attn.{name}": "colwise" for name in ("to_q", "to_k", "to_v")},
    **{f"transformer_blocks.*.attn.{name}": "colwise" for name in ("add_q_proj", "add_k_proj", "add_v_proj")},
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.attn.to_add_out": "rowwise",
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": "rowwise",
    "transformer_blocks.*.ff_context.net.0.proj": "colwise",
    "transformer_blocks.*.ff_context.net.2": "rowwise",
}
"""HunyuanVideo15Transformer3DModel's plan (diffusers 0.42 has none): the dual-stream blocks' joint attention (video
and text projections) and both MLPs; its q/k norms are per head, so only the head count changes. The token refiner
stays replicated."""

LTX2_ATTENTIONS = (
    "attn1",  # video self-attention
    "audio_attn1",  # audio self-attention
    "attn2",  # video cross-attention to the prompt
    "audio_attn2",  # audio cross-attention to the prompt
    "audio_to_video_attn",  # video queries, audio keys / values (the audio heads)
    "video_to_audio_attn",  # audio queries, video keys / values (the audio heads)
)
"""Every attention of an LTX2VideoTransformerBlock (diffusers 0.42 `transformer_ltx2`)."""

LTX2_TP_PLAN = {
    **{
        f"transformer_blocks.*.{attention}.{name}": "colwise"
        for attention in LTX2_ATTENTIONS
        for name in ("to_q", "to_k", "to_v")
    },
    **{f"transformer_blocks.*.{attention}.to_out.0": "rowwise" for attention in LTX2_ATTENTIONS},
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": "rowwise",
    "transformer_blocks.*.audio_ff.net.0.proj": "colwise",
    "transformer_blocks.*.audio_ff.net.2": "rowwise",
}
"""LTX2VideoTransformer3DModel's plan (diffusers 0.42 has none): the six attentions of each joint block and the
video and audio MLPs. Patch embedders, caption projections, AdaLN / cross-attention modulation and the output
projections stay replicated."""

_DIFFUSERS_PLANNED = ("FluxTransformer2DModel", "QwenImageTransformer2DModel")
"""DiT classes whose diffusers `_tp_plan` we use as is (their processors are TP-agnostic)."""

HEAD_COUNTS = ("num_attention_heads", "audio_num_attention_heads")
"""The config fields of a DiT's attention head counts (LTX-2 has a separate audio stream); each must divide."""


def tensor_parallel_plan(module: torch.nn.Module) -> dict[str, Any] | None:
    """The flat TP plan (diffusers' `_tp_plan` format) of a DiT, or None when it has none here."""
    name = type(module).__name__
    if name == "WanTransformer3DModel":
        plan = dict(WAN_TP_PLAN)
        if module.config.get("added_kv_proj_dim") is not None:
            plan.update(WAN_I2V_TP_PLAN)
        return plan
    if name == "HunyuanVideo15Transformer3DModel":
        return dict(HUNYUAN_VIDEO_15_TP_PLAN)
    if name == "LTX2VideoTransformer3DModel":
        plan = dict(LTX2_TP_PLAN)
        # LTX-2.3 gates each head's output (`gated_attn` for the video-query attentions, `audio_gated_attn` for the
        # audio-query ones): one logit per head from the replicated input, so the gate's rows split with the heads.
        for attention in LTX2_ATTENTIONS:
            if getattr(module.transformer_blocks[0], attention).to_gate_logits is not None:
                plan[f"transformer_blocks.*.{attention}.to_gate_logits"] = "colwise"
        return plan
    if name in _DIFFUSERS_PLANNED and getattr(type(module), "_tp_plan", None):
        return dict(type(module)._tp_plan)
    return None


class ShardedRMSNorm(torch.nn.Module):
    """An RMSNorm over a vector whose last dimension is split over the TP ranks (contiguous slices, rank order).

    The rank's slice of the weight scales its slice of the vector; the mean of squares is that of the whole
    vector, from an all-reduce of the per-rank sums over the TP group.
    """

    def __init__(self, norm: torch.nn.RMSNorm, mesh: Any) -> None:
        super().__init__()
        (self.full_dim,) = norm.normalized_shape
        self.eps = norm.eps
        self.group = mesh.get_group()
        degree, rank = mesh.size(), mesh.get_local_rank()
        width = self.full_dim // degree
        weight = None
        if norm.weight is not None:
            weight = torch.nn.Parameter(
                norm.weight.detach()[rank * width : (rank + 1) * width].clone(), requires_grad=False
            )
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The statistics in fp32 whatever the activations, as torch's fused rms_norm computes them.
        squares = hidden.float().pow(2).sum(dim=-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        eps = self.eps if self.eps is not None else torch.finfo(hidden.dtype).eps
        out = (hidden.float() * torch.rsqrt(squares / self.full_dim + eps)).type_as(hidden)
        return out * self.weight if self.weight is not None else out


def _localize_heads(attention: torch.nn.Module, mesh: Any, norms: tuple[str, ...]) -> None:
    """One attention after its column split: local heads (its processor reshapes by `attn.heads`, and a rank now
    holds heads / degree of them) and the named q/k RMSNorms across heads made `ShardedRMSNorm`s."""
    attention.heads //= mesh.size()
    for name in norms:
        norm = getattr(attention, name, None)
        if isinstance(norm, torch.nn.RMSNorm):
            setattr(attention, name, ShardedRMSNorm(norm, mesh))


class _RankRope:
    """A forward hook on an LTX-2 RoPE module: its (cos, sin) tables cut to this rank's features.

    LTX-2 rotates the whole query / key vector before the heads are unflattened, so a rank holding a column slice
    of q and k needs the same slice of the tables: the last dimension of the interleaved (batch, tokens, features)
    tables, the head dimension of the split (batch, heads, tokens, features / heads / 2) ones.
    """

    def __init__(self, mesh: Any, split: bool) -> None:
        self.degree, self.rank = mesh.size(), mesh.get_local_rank()
        self.dim = 1 if split else -1

    def __call__(self, module: torch.nn.Module, inputs: Any, output: tuple[torch.Tensor, ...]) -> tuple:
        width = output[0].shape[self.dim] // self.degree
        return tuple(t.narrow(self.dim, self.rank * width, width) for t in output)


LTX2_ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
"""LTX2VideoTransformer3DModel's RoPE modules: self-attention (video, audio) and the audio-video cross-attentions."""


def localize_attention(module: torch.nn.Module, mesh: Any) -> None:
    """What a column split changes besides the weights, per DiT: local head counts, sharded norms, cut RoPE."""
    name = type(module).__name__
    if name == "WanTransformer3DModel":
        from diffusers.models.transformers.transformer_wan import WanAttention

        for attention in module.modules():
            if isinstance(attention, WanAttention):
                _localize_heads(attention, mesh, ("norm_q", "norm_k", "norm_added_k"))
    elif name == "HunyuanVideo15Transformer3DModel":
        for block in module.transformer_blocks:  # its q/k norms are per head: only the head count changes
            _localize_heads(block.attn, mesh, ())
    elif name == "LTX2VideoTransformer3DModel":
        for block in module.transformer_blocks:
            for attention in LTX2_ATTENTIONS:
                _localize_heads(getattr(block, attention), mesh, ("norm_q", "norm_k"))
        split = module.config.get("rope_type") == "split"
        for rope in LTX2_ROPES:
            getattr(module, rope).register_forward_hook(_RankRope(mesh, split))
