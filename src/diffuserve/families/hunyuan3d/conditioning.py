"""What the Hunyuan3D-2 DiT is conditioned on, and how time runs for it.

- `preprocess`: the reference's image preparation (recentre the object found by the alpha mask so it fills
  1 - border_ratio of a square canvas, composite over white, resize) -> a (1, 3, size, size) tensor in [-1, 1].
  Resampling uses Pillow (box for the crop, bicubic for the final size) where the reference uses OpenCV's area
  and cubic filters: the equality test states the small difference that leaves.
- `DinoConditioner`: transformers' `Dinov2Model` features of that image (the `conditioner.` keys); the
  unconditional embedding CFG runs against is zeros of the same shape.
- `flow_sigmas` / `consistency_sigmas`: the two schedulers' sigma lists. Time runs the other way from diffusers'
  (sigma 0 is noise, 1 is data) and one more sigma of 1 closes the list, so the last step moves the sample by 0.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F

DINO_MEAN = (0.485, 0.456, 0.406)
DINO_STD = (0.229, 0.224, 0.225)


def _resize_channels(array: np.ndarray, size: tuple[int, int], resample: Image.Resampling) -> np.ndarray:
    """Resize each uint8 channel on its own (Pillow would premultiply an RGBA image's colours by alpha)."""
    planes = [np.asarray(Image.fromarray(array[..., c]).resize(size, resample)) for c in range(array.shape[-1])]
    return np.stack(planes, axis=-1)


def recenter(rgba: np.ndarray, border_ratio: float) -> np.ndarray:
    """The object (alpha > 0; the whole image when it has no alpha) scaled into the middle of a square canvas
    over white, uint8 RGB. Raises ValueError for an image whose mask is empty or a single line."""
    height, width, _ = rgba.shape
    side = max(height, width)
    rows, cols = np.nonzero(rgba[..., 3])
    if rows.size == 0:
        raise ValueError("the image is fully transparent: there is no object to reconstruct")
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    h, w = bottom - top, right - left
    if h == 0 or w == 0:
        raise ValueError("the image's object is a single line of pixels; send a larger object")
    desired = int(side * (1 - border_ratio))
    scale = desired / max(h, w)
    h2, w2 = int(h * scale), int(w * scale)
    y0, x0 = (side - h2) // 2, (side - w2) // 2
    canvas = np.zeros((side, side, 4), dtype=np.uint8)
    # The reference crops [min, max) on both axes (the last row and column of the object are left out).
    canvas[y0 : y0 + h2, x0 : x0 + w2] = _resize_channels(rgba[top:bottom, left:right], (w2, h2), Image.Resampling.BOX)
    alpha = canvas[..., 3:].astype(np.float32) / 255
    composited = canvas[..., :3] * alpha + 255.0 * (1 - alpha)
    return composited.clip(0, 255).astype(np.uint8)


def preprocess(image: bytes | Image.Image, size: int, border_ratio: float) -> torch.Tensor:
    """Encoded image (or PIL image) -> (1, 3, size, size) float32 in [-1, 1], object centred, white background."""
    pil = Image.open(io.BytesIO(image)) if isinstance(image, bytes | bytearray) else image
    rgba = np.asarray(pil.convert("RGBA"))
    square = recenter(rgba, border_ratio)
    resized = np.asarray(Image.fromarray(square).resize((size, size), Image.Resampling.BICUBIC))
    tensor = torch.from_numpy(resized.copy()).float() / 255 * 2 - 1
    return tensor.permute(2, 0, 1).unsqueeze(0)


class DinoImageEncoder(nn.Module):
    """`main_image_encoder`: a Dinov2Model built from the config the checkpoint's yaml embeds."""

    def __init__(self, config: dict[str, Any], use_cls_token: bool = True, image_size: int = 224):
        super().__init__()
        from transformers import Dinov2Config, Dinov2Model

        if image_size % 14:
            raise ValueError(f"DINOv2 image_size {image_size} must be a multiple of its patch size 14")
        self.model = Dinov2Model(Dinov2Config.from_dict(config))
        self.model.eval().requires_grad_(False)
        self.use_cls_token = use_cls_token
        self.image_size = image_size
        self.num_tokens = (image_size // 14) ** 2 + (1 if use_cls_token else 0)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """image (B, 3, H, W) in [-1, 1] -> tokens (B, num_tokens, hidden)."""
        param = next(self.model.parameters())
        x = ((image + 1) / 2).to(param.device, dtype=param.dtype)
        # Shorter side to image_size (bilinear, antialiased), centre crop, ImageNet normalisation.
        h, w = x.shape[-2:]
        scale = self.image_size / min(h, w)
        new_h, new_w = (self.image_size, int(w * scale)) if h <= w else (int(h * scale), self.image_size)
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
        top, left = (new_h - self.image_size) // 2, (new_w - self.image_size) // 2
        x = x[..., top : top + self.image_size, left : left + self.image_size]
        mean = torch.tensor(DINO_MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        std = torch.tensor(DINO_STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        hidden = self.model(pixel_values=(x - mean) / std).last_hidden_state
        return hidden if self.use_cls_token else hidden[:, 1:]

    def unconditional(self, rows: int) -> torch.Tensor:
        param = next(self.model.parameters())
        return torch.zeros(rows, self.num_tokens, self.model.config.hidden_size, device=param.device, dtype=param.dtype)


class DinoConditioner(nn.Module):
    """The `conditioner` of a single-image checkpoint (the reference's SingleImageEncoder over DINOv2)."""

    def __init__(self, main_image_encoder: dict[str, Any], **_: object):
        super().__init__()
        kind = main_image_encoder.get("type")
        if kind != "DinoImageEncoder":
            raise ValueError(
                f"conditioner main_image_encoder type {kind!r} is not supported; only "
                "DinoImageEncoder (single-image Hunyuan3D-2 checkpoints) is"
            )
        kwargs = dict(main_image_encoder.get("kwargs") or {})
        if not isinstance(kwargs.get("config"), dict):
            raise ValueError(
                "conditioner main_image_encoder.kwargs.config must hold the Dinov2Config as a mapping "
                "(loading DINOv2 by `version` would download it)"
            )
        self.main_image_encoder = DinoImageEncoder(
            kwargs["config"], bool(kwargs.get("use_cls_token", True)), int(kwargs.get("image_size", 224))
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.main_image_encoder(image)

    def unconditional(self, rows: int) -> torch.Tensor:
        return self.main_image_encoder.unconditional(rows)


def flow_sigmas(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler (reference) given sigmas linspace(0, 1, steps): shifted, then a closing 1."""
    sigmas = np.linspace(0, 1, num_steps)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    tensor = torch.from_numpy(sigmas).to(torch.float32)
    return torch.cat([tensor, torch.ones(1)])


def consistency_sigmas(num_steps: int, num_train_timesteps: int = 1000, pcm_timesteps: int = 50) -> torch.Tensor:
    """ConsistencyFlowMatchEulerDiscreteScheduler (turbo): `steps` of its `pcm_timesteps` Euler points, then 1."""
    train = np.linspace(0, 1, num_train_timesteps)
    ratio = num_train_timesteps // pcm_timesteps
    euler = np.asarray([0] + ((np.arange(1, pcm_timesteps) * ratio).round().astype(np.int64) - 1).tolist())
    table = torch.from_numpy(train[euler].copy())
    picked = np.floor(np.linspace(0, pcm_timesteps, num=num_steps, endpoint=False)).astype(np.int64)
    return torch.cat([table[torch.from_numpy(picked)], torch.ones(1, dtype=table.dtype)])
