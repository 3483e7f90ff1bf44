"""Blockwise attention with its log-sum-exp, and the exact merge of partial attentions (Ring attention's arithmetic).

Attention over keys split in blocks equals the log-sum-exp-weighted sum of each block's attention:
out = sum_j exp(lse_j - lse) * out_j with lse = logsumexp_j(lse_j). The merge runs in float32.
"""

from __future__ import annotations

import torch


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, Lq, D) queries to (B, H, Lk, D) keys with its log-sum-exp: (out, lse (B, H, Lq)).

    `mask`: (B, Lk) bool key-padding mask (True = attend) or None. CPU uses the fused kernel that returns the
    log-sum-exp; CUDA the memory-efficient kernel when unmasked; otherwise the exact float32 formula. A row whose
    mask keeps no key (a ring block holding only a packed row's padding) gets out 0 and lse -inf, so it merges as
    nothing (the CPU kernel itself returns lse 0 there, the formula NaN)."""
    out, lse = _attention(q, k, v, mask, scale)
    if mask is not None:
        empty = ~mask.any(dim=1)
        lse = lse.masked_fill(empty[:, None, None], float("-inf"))
        out = out.masked_fill(empty[:, None, None, None], 0)
    return out, lse


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))[:, None, None]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        return out, lse
    if q.device.type == "cuda" and bias is None:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale
        )
        return out, lse[..., : q.shape[2]]
    return math_attention(q, k, v, bias, scale)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain formula in float32 (any device): (out, lse)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype), lse


def merge_partial(
    out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys -> the attention over both (float32, exact)."""
    part, part_lse = part.float(), part_lse.float()
    if out is None or lse is None:
        return part, part_lse
    merged = torch.logaddexp(lse, part_lse)
    # An empty part (lse -inf) weighs exp(-inf) = 0; where both are empty, the weights must not be exp(nan).
    base = merged.masked_fill(torch.isneginf(merged), 0)
    return (out * torch.exp(lse - base)[..., None] + part * torch.exp(part_lse - base)[..., None]), merged
