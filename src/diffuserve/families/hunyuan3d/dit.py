"""The Hunyuan3D-2 shape DiT: FLUX-style double-stream then single-stream blocks over the shape latents (the
"image" stream) and the DINOv2 image tokens (the "text" stream), with no positional embedding at all.

Module and parameter names follow the published `model.` keys of `model.fp16.safetensors`, so Tencent's
weights load with `load_state_dict(strict=True)`. Written from the facts of the reference (hy3dgen 2.0.2).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def timestep_embedding(
    t: torch.Tensor, dim: int, time_factor: float = 1000.0, max_period: float = 10000.0
) -> torch.Tensor:
    """Sinusoidal embedding of `t` (one value per row), cosines first, as the reference lays it out."""
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb.to(t) if torch.is_floating_point(t) else emb


def _heads(x: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, 3*H*D) fused q/k/v -> three (B, H, L, D) tensors (q, k, v blocks, each split into heads)."""
    b, length, _ = x.shape
    q, k, v = x.view(b, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k, v


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v)
    b, h, length, d = out.shape
    return out.transpose(1, 2).reshape(b, length, h * d)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32, cast back before the scale (the reference's order).
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    """Holds the fused qkv, the q/k norm and the output projection; double blocks call the parts."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)


class Modulation(nn.Module):
    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift, scale, gate) once or twice, each (B, 1, dim)."""
        return self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)


def _mlp(hidden: int, ratio: float) -> nn.Sequential:
    inner = int(hidden * ratio)
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, hidden))


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        for side in ("img", "txt"):
            setattr(self, f"{side}_mod", Modulation(hidden, double=True))
            setattr(self, f"{side}_norm1", nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6))
            setattr(self, f"{side}_attn", SelfAttention(hidden, num_heads, qkv_bias))
            setattr(self, f"{side}_norm2", nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6))
            setattr(self, f"{side}_mlp", _mlp(hidden, mlp_ratio))

    def _qkv(self, side: str, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor):
        attn: SelfAttention = getattr(self, f"{side}_attn")
        q, k, v = _heads(attn.qkv((1 + scale) * getattr(self, f"{side}_norm1")(x) + shift), self.num_heads)
        q, k = attn.norm(q, k, v)
        return q, k, v

    def _finish(self, side: str, x: torch.Tensor, attn_out: torch.Tensor, mods: tuple[torch.Tensor, ...]):
        _, _, gate1, shift2, scale2, gate2 = mods
        x = x + gate1 * getattr(self, f"{side}_attn").proj(attn_out)
        return x + gate2 * getattr(self, f"{side}_mlp")((1 + scale2) * getattr(self, f"{side}_norm2")(x) + shift2)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img_mods, txt_mods = self.img_mod(vec), self.txt_mod(vec)
        iq, ik, iv = self._qkv("img", img, img_mods[0], img_mods[1])
        tq, tk, tv = self._qkv("txt", txt, txt_mods[0], txt_mods[1])
        # Joint attention, image tokens (the condition) first.
        out = _attention(torch.cat((tq, iq), 2), torch.cat((tk, ik), 2), torch.cat((tv, iv), 2))
        txt_out, img_out = out[:, : txt.shape[1]], out[:, txt.shape[1] :]
        return self._finish("img", img, img_out, img_mods), self._finish("txt", txt, txt_out, txt_mods)


class SingleStreamBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.hidden = hidden
        self.num_heads = num_heads
        self.mlp_hidden = int(hidden * mlp_ratio)
        self.linear1 = nn.Linear(hidden, hidden * 3 + self.mlp_hidden)
        self.linear2 = nn.Linear(hidden + self.mlp_hidden, hidden)
        self.norm = QKNorm(hidden // num_heads)
        self.pre_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.modulation = Modulation(hidden, double=False)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = torch.split(
            self.linear1((1 + scale) * self.pre_norm(x) + shift), [3 * self.hidden, self.mlp_hidden], dim=-1
        )
        q, k, v = _heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        out = self.linear2(torch.cat((_attention(q, k, v), F.gelu(mlp, approximate="tanh")), 2))
        return x + gate * out


class LastLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        return self.linear((1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :])


class Hunyuan3DDiT(nn.Module):
    """The shape denoiser. `forward(x, t, cond, guidance)`: x (B, num_latents, in_channels), t in [0, 1] per row
    (the flow time the reference feeds: timestep / num_train_timesteps), cond (B, tokens, context_in_dim)."""

    def __init__(
        self,
        in_channels: int = 64,
        context_in_dim: int = 1536,
        hidden_size: int = 1024,
        mlp_ratio: float = 4.0,
        num_heads: int = 16,
        depth: int = 16,
        depth_single_blocks: int = 32,
        axes_dim: list[int] | tuple[int, ...] = (64,),
        theta: int = 10_000,
        qkv_bias: bool = True,
        time_factor: float = 1000.0,
        guidance_embed: bool = False,
        **_: object,
    ):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
        if sum(axes_dim) != hidden_size // num_heads:
            raise ValueError(
                f"sum(axes_dim)={sum(axes_dim)} must equal hidden_size / num_heads = {hidden_size // num_heads}"
            )
        self.in_channels = in_channels
        self.time_factor = time_factor
        self.guidance_embed = guidance_embed
        self.latent_in = nn.Linear(in_channels, hidden_size)
        self.time_in = MLPEmbedder(256, hidden_size)
        self.cond_in = nn.Linear(context_in_dim, hidden_size)
        self.guidance_in = MLPEmbedder(256, hidden_size) if guidance_embed else nn.Identity()
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(hidden_size, num_heads, mlp_ratio, qkv_bias) for _ in range(depth)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth_single_blocks)
        )
        self.final_layer = LastLayer(hidden_size, in_channels)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, guidance: torch.Tensor | None = None
    ) -> torch.Tensor:
        latent = self.latent_in(x)
        # The published models were trained with the config's `time_factor` in the embedding's max_period slot
        # (and the fixed 1000 as the time scale); kept, since the weights depend on it.
        vec = self.time_in(timestep_embedding(t, 256, max_period=self.time_factor).to(dtype=latent.dtype))
        if self.guidance_embed:
            if guidance is None:
                raise ValueError("this guidance-distilled (turbo) DiT needs a guidance value per row")
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256, max_period=self.time_factor))
        cond = self.cond_in(cond)
        for block in self.double_blocks:
            latent, cond = block(latent, cond, vec)
        joint = torch.cat((cond, latent), 1)
        for block in self.single_blocks:
            joint = block(joint, vec)
        return self.final_layer(joint[:, cond.shape[1] :], vec)
