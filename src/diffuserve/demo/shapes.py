"""Synthetic scenes of the demo model: one coloured shape on a white background, and its prompt.

The vocabulary here is everything the demo model can draw. The same renderer makes the training
images and the templates the semantic test compares generated images with, so "what the prompt
says" has one definition.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

SIZE = 64
"""Image side in pixels (the demo checkpoint's native size)."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 225),
    "yellow": (245, 205, 20),
    "purple": (140, 45, 175),
    "black": (20, 20, 20),
}
"""Colour words and the RGB each is drawn in."""

SHAPES = ("circle", "square", "triangle")
"""Shape words."""

POSITIONS: dict[str, tuple[float, float]] = {
    "center": (32.0, 32.0),
    "top left": (18.0, 18.0),
    "top right": (46.0, 18.0),
    "bottom left": (18.0, 46.0),
    "bottom right": (46.0, 46.0),
}
"""Position phrases and the (x, y) pixel centre of the shape there."""

SHAPE_SIDE = 24.0
"""Nominal side of a shape's bounding box in pixels (the training data jitters it by `JITTER`)."""

JITTER = 2.0
"""Training images move the centre and change the side by up to this many pixels."""

BACKGROUND = (255, 255, 255)

_SUPERSAMPLE = 4


@dataclass(frozen=True)
class Scene:
    """One shape in one colour at one position (plus the jitter the training data adds)."""

    colour: str
    shape: str
    position: str
    dx: float = 0.0
    dy: float = 0.0
    dside: float = 0.0

    def prompt(self, variant: int = 0) -> str:
        """A prompt for the scene; `variant` picks one of the phrasings the model was trained on."""
        thing = f"a {self.colour} {self.shape}"
        if self.position == "center":
            return (f"{thing} on a white background", thing, f"{thing} in the center")[variant % 3]
        return (f"{thing} in the {self.position}", f"{thing} in the {self.position} on a white background")[variant % 2]


def vocabulary() -> list[str]:
    """Every word of every prompt `Scene.prompt` writes, in a fixed order."""
    words = ["a", "on", "white", "background", "in", "the", *COLOURS, *SHAPES]
    words += [w for p in POSITIONS for w in p.split()]
    return list(dict.fromkeys(words))


def all_scenes() -> list[Scene]:
    """Every colour x shape x position, without jitter."""
    return [Scene(c, s, p) for c in COLOURS for s in SHAPES for p in POSITIONS]


def mask(shape: str, position: str, *, dx: float = 0.0, dy: float = 0.0, dside: float = 0.0) -> np.ndarray:
    """Coverage of the shape in [0, 1] per pixel (SIZE x SIZE, anti-aliased by supersampling)."""
    n = SIZE * _SUPERSAMPLE
    coords = (np.arange(n) + 0.5) / _SUPERSAMPLE
    x, y = np.meshgrid(coords, coords)
    cx, cy = POSITIONS[position]
    cx, cy, half = cx + dx, cy + dy, (SHAPE_SIDE + dside) / 2
    u, v = x - cx, y - cy
    if shape == "circle":
        inside = u * u + v * v <= half * half
    elif shape == "square":
        inside = (np.abs(u) <= half) & (np.abs(v) <= half)
    elif shape == "triangle":
        # Apex up, base at the bottom of the bounding box: |u| shrinks linearly towards the apex.
        inside = (v <= half) & (v >= -half) & (np.abs(u) <= (v + half) / 2)
    else:
        raise ValueError(f"unknown shape {shape!r}; the demo model knows {list(SHAPES)}")
    return inside.reshape(SIZE, _SUPERSAMPLE, SIZE, _SUPERSAMPLE).mean(axis=(1, 3))


def render(scene: Scene) -> np.ndarray:
    """The scene as an RGB uint8 array (SIZE x SIZE x 3)."""
    cover = mask(scene.shape, scene.position, dx=scene.dx, dy=scene.dy, dside=scene.dside)[..., None]
    colour = np.asarray(COLOURS[scene.colour], dtype=np.float64)
    image = cover * colour + (1 - cover) * np.asarray(BACKGROUND, dtype=np.float64)
    return image.round().astype(np.uint8)


def random_scene(rng: random.Random) -> tuple[Scene, str]:
    """A jittered random scene and one of its prompts, drawn from `rng` (reproducible)."""
    scene = Scene(
        rng.choice(list(COLOURS)),
        rng.choice(SHAPES),
        rng.choice(list(POSITIONS)),
        dx=rng.uniform(-JITTER, JITTER),
        dy=rng.uniform(-JITTER, JITTER),
        dside=rng.uniform(-JITTER, JITTER),
    )
    return scene, scene.prompt(rng.randrange(6))


# -- reading a generated image back ---------------------------------------------------------------------

INK_THRESHOLD = 90
"""A pixel is ink (not background) when some channel is this far below white."""


def ink(image: np.ndarray) -> np.ndarray:
    """Boolean mask of the non-background pixels of an RGB uint8 image."""
    return (255 - image.astype(np.int16)).max(axis=-1) >= INK_THRESHOLD


def dominant_colour(image: np.ndarray) -> str | None:
    """The colour word whose RGB is nearest to most ink pixels (None for a blank image)."""
    pixels = image[ink(image)].astype(np.float64)
    if len(pixels) == 0:
        return None
    palette = np.asarray(list(COLOURS.values()), dtype=np.float64)
    nearest = ((pixels[:, None, :] - palette[None]) ** 2).sum(-1).argmin(1)
    return list(COLOURS)[int(np.bincount(nearest, minlength=len(palette)).argmax())]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two boolean masks."""
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


def best_shape(image: np.ndarray, position: str) -> tuple[str, float]:
    """The shape whose template at `position` overlaps the image's ink most, and that IoU."""
    drawn = ink(image)
    scores = {s: iou(drawn, mask(s, position) >= 0.5) for s in SHAPES}
    shape = max(scores, key=scores.__getitem__)
    return shape, scores[shape]


def nearest_position(image: np.ndarray) -> str | None:
    """The position whose centre is nearest the ink's centroid (None for a blank image)."""
    ys, xs = np.nonzero(ink(image))
    if len(xs) == 0:
        return None
    cx, cy = xs.mean() + 0.5, ys.mean() + 0.5
    return min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
