"""Tensor-only `Compose`, `Resize` (bilinear, antialiased, shorter side), `CenterCrop`, `Normalize`."""

import enum

import torch
from torch.nn import functional as F


class InterpolationMode(enum.Enum):
    BILINEAR = "bilinear"


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Resize:
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
        self.size, self.antialias = size, antialias

    def __call__(self, x):
        h, w = x.shape[-2:]
        scale = self.size / min(h, w)
        shape = (self.size, int(w * scale)) if h <= w else (int(h * scale), self.size)
        return F.interpolate(x, size=shape, mode="bilinear", align_corners=False, antialias=self.antialias)


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top : top + self.size, left : left + self.size]


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)

    def __call__(self, x):
        return (x - self.mean.view(1, -1, 1, 1).to(x)) / self.std.view(1, -1, 1, 1).to(x)
