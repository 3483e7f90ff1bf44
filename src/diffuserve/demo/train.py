"""Train the embedded demo model: a small FLUX.1-schnell-style checkpoint that draws `shapes` scenes.

    python -m diffuserve.demo.train --output src/diffuserve/models/demo_flux

Two phases on images it renders itself (`diffuserve.demo.shapes`), both seeded, on one CPU thread
(same seed and machine -> same weights):

1. the VAE (AutoencoderKL, scale factor 8, 4 latent channels) as a plain autoencoder: L1 + MSE on
   the reconstruction of the posterior mean, with a tiny KL term that keeps the posterior well-formed
   for image-to-image encoding. Its latent statistics over the pool set `shift_factor` and
   `scaling_factor`, as FLUX's VAE config does.
2. the transformer together with both text encoders, with FLUX's rectified-flow objective:
   x_t = (1 - s) x_0 + s e, target e - x_0, s ~ U(0, 1), the model called with timestep s exactly as
   the pipeline calls it (timestep / 1000 of the scheduler's s * 1000).

It prints both loss curves, writes the checkpoint in diffusers' layout (with the offline tokenizers
of `diffuserve.models.tiny`), then loads it through the normal loader and prints how often 4-step
samples show the prompted colour, shape and position.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from diffuserve.demo import shapes

LATENT_CHANNELS = 4
TEXT_HIDDEN = 32
T5_LENGTH = 16
"""T5 tokens per prompt the demo checkpoint declares: its longest prompt is 12 tokens with the demo words."""


def build_tokenizers() -> tuple[Any, Any]:
    """The tiny checkpoints' offline tokenizers, with the demo vocabulary as whole T5 words.

    The CLIP tokenizer is exactly `tiny`'s. The T5 unigram vocabulary gains one piece per word of
    `shapes.vocabulary()`, so every demo prompt is a short sequence of whole-word tokens (the frozen
    T5 encoder then keeps each word recognisable) and `T5_LENGTH` tokens hold any of them.
    """
    from transformers import T5Tokenizer

    from diffuserve.models import tiny, tiny_parts

    clip, _ = tiny.build_tokenizers()
    pieces = tiny_parts.t5_pieces()
    known = {piece for piece, _ in pieces}
    words = [("▁" + w, -5.0) for w in shapes.vocabulary() if "▁" + w not in known]
    # Special pieces first (their ids are fixed), then the new words, then tiny's words and characters.
    t5 = T5Tokenizer(vocab=pieces[:4] + words + pieces[4:], extra_ids=100, model_max_length=T5_LENGTH)
    return clip, t5


def build_components(seed: int) -> dict[str, Any]:
    """Untrained components of the demo checkpoint (the layout of the embedded tiny FLUX model)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffuserve.models import tiny_parts

    clip_tok, t5_tok = build_tokenizers()
    torch.manual_seed(seed + 1)
    clip = CLIPTextModel(CLIPTextConfig(**tiny_parts.tiny_clip_config(clip_tok, TEXT_HIDDEN)))
    torch.manual_seed(seed + 2)
    t5 = T5EncoderModel(T5Config(**tiny_parts.tiny_t5_config(t5_tok, TEXT_HIDDEN)))
    torch.manual_seed(seed + 3)
    # schnell style (no guidance embedding): the pipeline then defaults to 4 steps, guidance 0.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS * 4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=TEXT_HIDDEN,
        pooled_projection_dim=TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(seed + 4)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=shapes.SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # FLUX.1-schnell's scheduler settings: no resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": clip,
        "tokenizer": clip_tok,
        "text_encoder_2": t5,
        "tokenizer_2": t5_tok,
        "transformer": transformer,
    }


def render_pool(count: int, seed: int) -> tuple[torch.Tensor, list[shapes.Scene], list[str]]:
    """`count` jittered scenes as images in [-1, 1] (N, 3, H, W), with the scenes and one prompt each."""
    rng = random.Random(seed)
    scenes, prompts, images = [], [], []
    for _ in range(count):
        scene, prompt = shapes.random_scene(rng)
        scenes.append(scene)
        prompts.append(prompt)
        images.append(shapes.render(scene))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    return pixels, scenes, prompts


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * progress)))


def train_vae(vae: Any, pixels: torch.Tensor, steps: int, batch: int, seed: int, log_every: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=3e-3, weight_decay=0.0)
    vae.train()
    start = time.monotonic()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, 3e-3, 50)
        x = pixels[torch.randint(len(pixels), (batch,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.mean).sample
        # Shapes cover ~10% of an image: weight their pixels up so the background does not dominate.
        weight = 1 + 4 * ((1 - x).amax(dim=1, keepdim=True) > 0.2).float()
        rec = ((recon - x).abs() * weight).mean() + ((recon - x) ** 2 * weight).mean()
        loss = rec + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"vae step {step:5d}  recon {rec.item():.4f}  {time.monotonic() - start:6.0f}s", flush=True)
    vae.eval()


@torch.no_grad()
def encode_pool(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.encode(chunk).latent_dist.mean for chunk in pixels.split(256)])


def _tokens(tokenizer: Any, prompts: list[str], length: int) -> torch.Tensor:
    return tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids


def train_flow(
    parts: dict[str, Any], latents: torch.Tensor, prompts: list[str], steps: int, batch: int, seed: int, log_every: int
) -> None:
    from diffusers import FluxPipeline

    # The text encoders stay frozen at their seeded random weights (the whole-word T5 tokens keep
    # each word recognisable through them): each distinct prompt is encoded once, as the pipeline does.
    transformer = parts["transformer"]
    unique = list(dict.fromkeys(prompts))
    row = torch.tensor([unique.index(p) for p in prompts])
    with torch.no_grad():
        clip_ids = _tokens(parts["tokenizer"], unique, parts["tokenizer"].model_max_length)
        t5_ids = _tokens(parts["tokenizer_2"], unique, parts["tokenizer_2"].model_max_length)
        pooled_all = parts["text_encoder"].eval()(clip_ids).pooler_output
        text_all = parts["text_encoder_2"].eval()(t5_ids)[0]
    n, c, h, w = latents.shape
    packed = FluxPipeline._pack_latents(latents, n, c, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(t5_ids.shape[1], 3)
    params = list(transformer.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    transformer.train()
    gen = torch.Generator().manual_seed(seed)
    start, running = time.monotonic(), None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, 1e-3, 200)
        idx = torch.randint(n, (batch,), generator=gen)
        x0 = packed[idx]
        noise = torch.randn(x0.shape, generator=gen)
        sigma = torch.rand(batch, generator=gen)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        pooled, text = pooled_all[row[idx]], text_all[row[idx]]
        pred = transformer(
            hidden_states=xt,
            timestep=sigma,
            pooled_projections=pooled,
            encoder_hidden_states=text,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % log_every == 0 or step == steps - 1:
            print(
                f"flow step {step:5d}  loss {loss.item():.4f}  avg {running:.4f}  {time.monotonic() - start:6.0f}s",
                flush=True,
            )
    transformer.eval()


def save(parts: dict[str, Any], output: Path) -> None:
    from diffusers import FluxPipeline

    output.mkdir(parents=True, exist_ok=True)
    FluxPipeline(**parts).save_pretrained(output, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool", type=int, default=3000, help="rendered training images")
    parser.add_argument("--vae-steps", type=int, default=1000)
    parser.add_argument("--vae-batch", type=int, default=8)
    parser.add_argument("--flow-steps", type=int, default=1600)
    parser.add_argument("--flow-batch", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the machine is shared)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    began = time.monotonic()
    parts = build_components(args.seed)
    pixels, _, prompts = render_pool(args.pool, args.seed)
    print(f"rendered {len(pixels)} training images in {time.monotonic() - began:.0f}s", flush=True)

    train_vae(parts["vae"], pixels, args.vae_steps, args.vae_batch, args.seed + 10, args.log_every)
    raw = encode_pool(parts["vae"], pixels)
    # Normalise latents to zero mean, unit variance, as FLUX's VAE config does with its two factors.
    shift, scale = raw.mean().item(), 1.0 / raw.std().item()
    parts["vae"].register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    latents = (raw - parts["vae"].config.shift_factor) * parts["vae"].config.scaling_factor
    print(
        f"latents: shift_factor={parts['vae'].config.shift_factor} scaling_factor={parts['vae'].config.scaling_factor}",
        flush=True,
    )

    train_flow(parts, latents, prompts, args.flow_steps, args.flow_batch, args.seed + 20, args.log_every)
    save(parts, args.output)
    print(f"wrote {args.output} after {time.monotonic() - began:.0f}s of training", flush=True)

    from diffuserve.demo.semantics import evaluate
    from diffuserve.models.loader import load_pipeline

    report = evaluate(load_pipeline(args.output), seeds=(0, 1, 2))
    print(report.summary(), flush=True)


if __name__ == "__main__":
    main()
