"""The procedural shapes dataset: 32x32 RGB pictures of one flat shape on white, with captions.

A scene is a :class:`Scene`: a shape (:data:`SHAPES`) in a named colour (:data:`COLOURS`) of
a size class (small, medium, large) at a position, in a style (:data:`STYLES`): ``"filled"``
(the base model's pictures, the default) or ``"outline"`` (only a coloured border of
:func:`outline_width` pixels inside the shape's edge, its inside the background; what the
``outline`` LoRA adapter draws).  :func:`render_scene` draws it anti-aliased (4x4
supersampling); :func:`caption` describes it in one of a few phrasings ("a red circle", "a
small blue square on a white background"; never the style).  :func:`sample_scene` draws a
scene from a :class:`numpy.random.Generator`, so a dataset is deterministic per seed:
:func:`make_batch` is the one the training scripts use (``style="outline"`` for the adapter's,
the same scenes and captions as the default's, drawn).

Geometry (what :mod:`~omni_trio.models.shapes._judge` relies on): every shape of half-extent
``r`` fills a ``2r x 2r`` axis-aligned box: the square all of it, the circle ``pi/4`` of it,
the upright triangle (apex at the top, base at the bottom) half of it.

Pure numpy: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

__all__ = [
    "COLOURS",
    "IMAGE_SIZE",
    "SHAPES",
    "SIZES",
    "STYLES",
    "Scene",
    "article",
    "caption",
    "make_batch",
    "outline_mask",
    "outline_width",
    "render_scene",
    "sample_scene",
    "shape_mask",
]

IMAGE_SIZE: Final = 32
# The named colours (sRGB, 0-255).  Their hues are far enough apart to tell them apart.
COLOURS: Final[dict[str, tuple[int, int, int]]] = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (235, 215, 25),
    "green": (35, 165, 55),
    "blue": (35, 75, 220),
    "purple": (145, 45, 200),
}
SHAPES: Final = ("circle", "square", "triangle")
Shape = Literal["circle", "square", "triangle"]
SizeClass = Literal["small", "medium", "large"]
STYLES: Final = ("filled", "outline")
Style = Literal["filled", "outline"]
# Half-extent ranges in pixels for each size class (a shape spans 2r pixels).
SIZES: Final[dict[str, tuple[float, float]]] = {
    "small": (4.5, 6.5),
    "medium": (7.0, 9.5),
    "large": (10.0, 13.0),
}
BACKGROUND: Final = (255, 255, 255)
_SUPERSAMPLE = 4
_COLOUR_JITTER = 12  # +- per channel, so the model learns a colour, not one RGB triple
_MARGIN = 1.0
# An outline's border: this many pixels wide, but at most this share of the shape's inradius
# (a small triangle's is ~2.8 px), so every outlined shape keeps a visible inside.
OUTLINE_WIDTH: Final = 2.0
_OUTLINE_MAX_INRADIUS_SHARE = 0.5
# The inradius of each shape of half-extent 1: the upright triangle's is 2 * area / perimeter
# = 4 / (2 + 2 sqrt(5)).
_INRADIUS: Final = {"circle": 1.0, "square": 1.0, "triangle": 2.0 / (1.0 + 5.0**0.5)}


@dataclass(frozen=True)
class Scene:
    """One picture: ``shape`` in ``colour`` of half-extent ``radius`` centred at (cx, cy).

    ``rgb`` is the exact fill colour (the named colour, jittered); ``size`` the size class
    ``radius`` was drawn from.  Coordinates are pixels, (0, 0) the top-left pixel's corner.
    ``style`` is ``"filled"`` or ``"outline"`` (the border alone, in ``rgb``);
    :func:`sample_scene` never draws it: ``dataclasses.replace(scene, style="outline")``.
    """

    shape: Shape
    colour: str
    size: SizeClass
    radius: float
    cx: float
    cy: float
    rgb: tuple[int, int, int]
    style: Style = "filled"


def _inside(shape: str, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    """Whether each supersample at offset (dx, dy) from the centre is inside the shape."""
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        return (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    if shape == "triangle":
        # Apex (cx, cy - r), base from (cx - r, cy + r) to (cx + r, cy + r).
        depth = (dy + radius) / (2 * radius)  # 0 at the apex, 1 at the base
        return (depth >= 0) & (depth <= 1) & (np.abs(dx) <= depth * radius)
    raise ValueError(f"unknown shape {shape!r}; shapes are {', '.join(SHAPES)}")


def _edge_distance(shape: str, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    """For a supersample inside the shape, its distance to the shape's edge (pixels)."""
    if shape == "circle":
        return radius - np.sqrt(dx * dx + dy * dy)
    if shape == "square":
        return radius - np.maximum(np.abs(dx), np.abs(dy))
    # The triangle's base (dy = r) and its two sides (2 |dx| = dy + r).
    return np.minimum(radius - dy, (dy + radius - 2 * np.abs(dx)) / 5.0**0.5)


def _supersamples(cx: float, cy: float, size: int) -> tuple[np.ndarray, np.ndarray, int]:
    n = size * _SUPERSAMPLE
    coords = (np.arange(n, dtype=np.float64) + 0.5) / _SUPERSAMPLE
    return coords[None, :] - cx, coords[:, None] - cy, n


def _coverage(inside: np.ndarray, n: int, size: int) -> np.ndarray:
    inside = np.broadcast_to(inside, (n, n)).astype(np.float32)
    coverage = inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3))
    return coverage.astype(np.float32)


def shape_mask(
    shape: str, cx: float, cy: float, radius: float, size: int = IMAGE_SIZE
) -> np.ndarray:
    """Coverage of each pixel by the shape, in [0, 1], shape ``(size, size)`` float32."""
    dx, dy, n = _supersamples(cx, cy, size)
    return _coverage(_inside(shape, dx, dy, radius), n, size)


def outline_width(shape: str, radius: float) -> float:
    """The border width (pixels) of an outlined ``shape`` of half-extent ``radius``:
    :data:`OUTLINE_WIDTH`, or half the shape's inradius where that is less."""
    if shape not in _INRADIUS:
        raise ValueError(f"unknown shape {shape!r}; shapes are {', '.join(SHAPES)}")
    return min(OUTLINE_WIDTH, _OUTLINE_MAX_INRADIUS_SHARE * _INRADIUS[shape] * radius)


def outline_mask(
    shape: str, cx: float, cy: float, radius: float, size: int = IMAGE_SIZE
) -> np.ndarray:
    """Coverage of each pixel by the shape's border: the part of the shape within
    :func:`outline_width` of its edge; in [0, 1], shape ``(size, size)`` float32."""
    width = outline_width(shape, radius)
    dx, dy, n = _supersamples(cx, cy, size)
    inside = _inside(shape, dx, dy, radius)
    return _coverage(inside & (_edge_distance(shape, dx, dy, radius) < width), n, size)


def render_scene(scene: Scene, size: int = IMAGE_SIZE) -> np.ndarray:
    """The picture of ``scene``: ``(size, size, 3)`` float32 RGB in [0, 1]."""
    draw = outline_mask if scene.style == "outline" else shape_mask
    alpha = draw(scene.shape, scene.cx, scene.cy, scene.radius, size)[..., None]
    fg = np.asarray(scene.rgb, dtype=np.float32) / 255.0
    bg = np.asarray(BACKGROUND, dtype=np.float32) / 255.0
    return (alpha * fg + (1.0 - alpha) * bg).astype(np.float32)


def sample_scene(
    rng: np.random.Generator,
    *,
    shape: str | None = None,
    colour: str | None = None,
    size: str | None = None,
) -> Scene:
    """A random scene; ``shape``, ``colour`` and ``size`` fix those attributes if given."""
    chosen_shape = shape if shape is not None else SHAPES[int(rng.integers(len(SHAPES)))]
    names = list(COLOURS)
    chosen_colour = colour if colour is not None else names[int(rng.integers(len(names)))]
    size_names = list(SIZES)
    chosen_size = size if size is not None else size_names[int(rng.integers(len(size_names)))]
    if chosen_shape not in SHAPES:
        raise ValueError(f"unknown shape {chosen_shape!r}; shapes are {', '.join(SHAPES)}")
    if chosen_colour not in COLOURS:
        raise ValueError(f"unknown colour {chosen_colour!r}; colours are {', '.join(COLOURS)}")
    if chosen_size not in SIZES:
        raise ValueError(f"unknown size {chosen_size!r}; sizes are {', '.join(SIZES)}")
    lo, hi = SIZES[chosen_size]
    radius = float(rng.uniform(lo, hi))
    low = radius + _MARGIN
    high = IMAGE_SIZE - radius - _MARGIN
    cx = float(rng.uniform(low, high))
    cy = float(rng.uniform(low, high))
    jitter = rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1, size=3)
    base = np.asarray(COLOURS[chosen_colour])
    r, g, b = (int(v) for v in np.clip(base + jitter, 0, 255))
    return Scene(
        shape=chosen_shape,  # type: ignore[arg-type]
        colour=chosen_colour,
        size=chosen_size,  # type: ignore[arg-type]
        radius=radius,
        cx=cx,
        cy=cy,
        rgb=(r, g, b),
    )


def caption(scene: Scene, rng: np.random.Generator) -> str:
    """A caption of ``scene``: ``"a red circle"``, ``"an orange square"``, optionally with
    its size class (small or large; medium shapes are never called medium) and
    ``"on a white background"``."""
    words: list[str] = []
    if scene.size != "medium" and rng.random() < 0.5:
        words.append(scene.size)
    words += [scene.colour, scene.shape]
    if rng.random() < 0.3:
        words += ["on", "a", "white", "background"]
    return " ".join([article(words[0]), *words])


def article(word: str) -> str:
    """``"an"`` before a vowel, else ``"a"`` (``"an orange circle"``)."""
    return "an" if word[:1] in "aeiou" else "a"


def make_batch(
    rng: np.random.Generator, n: int, style: str = "filled"
) -> tuple[np.ndarray, list[str], list[Scene]]:
    """``n`` random scenes in ``style``: images ``(n, 3, 32, 32)`` float32 in [-1, 1] (what
    the model is trained on), their captions and the scenes.  The style draws no random
    number: the scenes and captions of a seed are the same in every style."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; styles are {', '.join(STYLES)}")
    scenes = [sample_scene(rng) for _ in range(n)]
    if style != "filled":
        scenes = [dataclasses.replace(scene, style=style) for scene in scenes]  # type: ignore[arg-type]
    captions = [caption(scene, rng) for scene in scenes]
    images = np.stack([render_scene(scene) for scene in scenes])
    return images.transpose(0, 3, 1, 2) * 2.0 - 1.0, captions, scenes
