"""Judge a picture against its prompt: which named colour and shape it shows, in which style.

The measurement behind ``omni-trio bench quality`` and the adherence tests, pure numpy:

- **Foreground**: the background is white, so a pixel's *ink* is how far its most-removed
  channel is from white, ``max(1 - rgb)``; the foreground is the largest 4-connected blob of
  pixels with ink above :data:`INK_THRESHOLD` (stray specks elsewhere are ignored), with the
  holes it encloses filled.
- **Colour**: the hue of the mean colour of the foreground's ink (its pixels above the
  threshold: a filled shape's all, an outline's border), matched to the nearest hue of
  :data:`~omni_trio.models.shapes._dataset.COLOURS` (on the hue circle).  A foreground
  without saturation (grey, black) matches no colour.
- **Shape**: template fitting.  Each shape of the dataset (circle, square, upright triangle)
  is drawn with the foreground's area and centroid, and the one that overlaps it best
  (intersection over union) is the answer -- unless even that overlap is below
  :data:`MIN_FIT`, or the foreground's bounding box is far from square (aspect above 2) or
  nearly as big as the picture (no shape of the dataset is; a noisy picture is).  Unlike a
  bounding-box fill ratio, this tolerates ragged edges and the odd stray pixel on the rim.
- **Style**: the *border* is the largest blob of ink where pieces up to two background
  pixels apart count as one (a generated border is often thin, drawn in diagonal steps or
  with a short gap).  A *hole* is a pixel without ink that has border on all four sides (in
  its row and in its column): the inside of a border, but not the notch between two lobes of
  a misshapen blob, nor the staircase beside a drawn slanted edge.  The picture
  is ``"outline"`` when holes make at least :data:`MIN_HOLLOW` of the border's convex *hull*
  (and :data:`MIN_HOLLOW_PIXELS` pixels), else ``"filled"``.  The dataset's filled shapes
  have no hole (share 0), its outlines a share of at least 0.13 (a small triangle's); a
  border with a whole side missing (a "U") is not an outline.  An outline's colour is its
  border's and its shape the hull's (every shape of the dataset is convex; a generated
  border with a gap still spans its inside): it is judged as the filled shape it bounds.  A
  filled picture is judged exactly as described above.

:func:`judge` returns a :class:`Verdict`; ``None`` fields mean "no answer" (no foreground,
say), which counts as wrong.
"""

from __future__ import annotations

import colorsys
import math
from collections import deque
from dataclasses import dataclass
from typing import Final

import numpy as np

from ._dataset import COLOURS, SHAPES, shape_mask

__all__ = [
    "INK_THRESHOLD",
    "MIN_FIT",
    "MIN_HOLLOW",
    "MIN_HOLLOW_PIXELS",
    "Verdict",
    "foreground_mask",
    "judge",
    "shape_scores",
]

INK_THRESHOLD: Final = 0.35
MIN_FIT: Final = 0.6
MIN_HOLLOW: Final = 0.08
MIN_HOLLOW_PIXELS: Final = 3
_MIN_PIXELS = 6
_MIN_SATURATION = 0.25
_MAX_ASPECT = 2.0
_MAX_EXTENT = 0.97  # of the image side: no shape of the dataset is this big (noise is)
_HUES: Final = {
    name: colorsys.rgb_to_hsv(*(c / 255.0 for c in rgb))[0] for name, rgb in COLOURS.items()
}


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge` saw: the colour and shape names (``None``: no answer), the
    foreground's pixel count, the overlap of the best-fitting shape, the mean hue in [0, 1),
    the share of the foreground without ink (``hollow``) and the style it makes
    (``"filled"`` or ``"outline"``; ``None`` without a foreground)."""

    colour: str | None
    shape: str | None
    pixels: int
    fit: float
    hue: float
    hollow: float
    style: str | None


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean ``mask`` (all False if empty)."""
    h, w = mask.shape
    labels = np.zeros((h, w), dtype=np.int32)
    best_label, best_size, label = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if labels[y0, x0]:
            continue
        label += 1
        labels[y0, x0] = label
        queue = deque([(int(y0), int(x0))])
        size = 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    queue.append((ny, nx))
        if size > best_size:
            best_label, best_size = label, size
    return labels == best_label if best_size else np.zeros_like(mask)


def _fill_holes(mask: np.ndarray) -> np.ndarray:
    """``mask`` with every region it encloses (not 4-connected to the border) filled in."""
    outside = ~mask
    border = np.zeros_like(mask)
    border[0, :] = border[-1, :] = True
    border[:, 0] = border[:, -1] = True
    reached = np.zeros_like(mask)
    queue = deque((int(y), int(x)) for y, x in zip(*np.nonzero(outside & border), strict=True))
    for y, x in queue:
        reached[y, x] = True
    h, w = mask.shape
    while queue:
        y, x = queue.popleft()
        for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
            if 0 <= ny < h and 0 <= nx < w and outside[ny, nx] and not reached[ny, nx]:
                reached[ny, nx] = True
                queue.append((ny, nx))
    return ~reached


def _bridged_component(mask: np.ndarray) -> np.ndarray:
    """The largest blob of ``mask`` where pixels up to two background pixels apart count as
    connected (the components of ``mask`` grown by one pixel, 8-neighbourhood): a border
    drawn thin, in diagonal steps or with a short gap, is one blob."""
    padded = np.pad(mask, 1)
    h, w = mask.shape
    grown = np.zeros_like(mask)
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            grown |= padded[dy : dy + h, dx : dx + w]
    return _largest_component(grown) & mask


def _enclosed(mask: np.ndarray) -> np.ndarray:
    """The pixels with ``mask`` somewhere on all four sides: left and right in their row,
    above and below in their column."""
    left = np.maximum.accumulate(mask, axis=1)
    right = np.maximum.accumulate(mask[:, ::-1], axis=1)[:, ::-1]
    above = np.maximum.accumulate(mask, axis=0)
    below = np.maximum.accumulate(mask[::-1], axis=0)[::-1]
    return left & right & above & below


def _convex_hull(mask: np.ndarray) -> np.ndarray:
    """The pixels whose centres lie in the convex hull of ``mask``'s pixel centres."""
    ys, xs = np.nonzero(mask)
    points = sorted(set(zip(xs.tolist(), ys.tolist(), strict=True)))
    if len(points) < 3:
        return mask.copy()

    def cross(o: tuple[int, int], a: tuple[int, int], b: tuple[int, int]) -> int:
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    # Andrew's monotone chain: the lower then the upper hull, counter-clockwise.
    lower: list[tuple[int, int]] = []
    upper: list[tuple[int, int]] = []
    for chain, sequence in ((lower, points), (upper, points[::-1])):
        for p in sequence:
            while len(chain) >= 2 and cross(chain[-2], chain[-1], p) <= 0:
                chain.pop()
            chain.append(p)
    hull = lower[:-1] + upper[:-1]
    if len(hull) < 3:  # collinear: a line of pixels is its own hull
        return mask.copy()
    h, w = mask.shape
    x = np.arange(w)[None, :]
    y = np.arange(h)[:, None]
    inside = np.ones((h, w), dtype=bool)
    for (ax, ay), (bx, by) in zip(hull, hull[1:] + hull[:1], strict=True):
        inside &= (bx - ax) * (y - ay) - (by - ay) * (x - ax) >= 0
    return inside


def _ink(image: np.ndarray) -> np.ndarray:
    return (1.0 - np.asarray(image, dtype=np.float64)).max(axis=-1)


def foreground_mask(image: np.ndarray) -> np.ndarray:
    """The shape's pixels in ``image`` (``(H, W, 3)`` RGB floats in [0, 1]): a boolean mask,
    the largest blob of ink with its holes filled (an outline's inside included)."""
    return _fill_holes(_largest_component(_ink(image) > INK_THRESHOLD))


def _nearest_colour(hue: float) -> str:
    def distance(name: str) -> float:
        d = abs(hue - _HUES[name]) % 1.0
        return min(d, 1.0 - d)

    return min(_HUES, key=distance)


def _template(shape: str, mask: np.ndarray) -> np.ndarray:
    """The dataset's ``shape`` with ``mask``'s area and centroid: pixel coverage in [0, 1]."""
    area = float(mask.sum())
    ys, xs = np.nonzero(mask)
    cy, cx = float(ys.mean()) + 0.5, float(xs.mean()) + 0.5
    size = mask.shape[0]
    if shape == "circle":
        return shape_mask(shape, cx, cy, math.sqrt(area / math.pi), size)
    if shape == "square":
        return shape_mask(shape, cx, cy, math.sqrt(area) / 2, size)
    # The upright triangle of half-extent r has area 2 r^2 and its centroid r/3 below the
    # centre of its box.
    radius = math.sqrt(area / 2)
    return shape_mask(shape, cx, cy - radius / 3, radius, size)


def shape_scores(mask: np.ndarray) -> dict[str, float]:
    """For each shape of the dataset, the overlap (intersection over union) of ``mask`` with
    that shape of the same area and centroid."""
    m = mask.astype(np.float64)
    scores = {}
    for shape in SHAPES:
        t = _template(shape, mask)
        scores[shape] = float(np.minimum(m, t).sum() / np.maximum(m, t).sum())
    return scores


def judge(image: np.ndarray) -> Verdict:
    """The named colour, shape and style ``image`` (``(H, W, 3)`` RGB in [0, 1]) shows."""
    image = np.asarray(image, dtype=np.float64)
    mask = foreground_mask(image)
    pixels = int(mask.sum())
    if pixels < _MIN_PIXELS:
        return Verdict(
            colour=None, shape=None, pixels=pixels, fit=0.0, hue=0.0, hollow=0.0, style=None
        )
    inked = _ink(image) > INK_THRESHOLD
    border = _bridged_component(inked)
    hull = _convex_hull(border)
    holes = int((_enclosed(border) & ~inked).sum())
    hollow = holes / max(1, int(hull.sum()))
    style = "outline" if hollow >= MIN_HOLLOW and holes >= MIN_HOLLOW_PIXELS else "filled"
    if style == "outline":
        # Judged as the filled shape its border bounds, in the border's colour.
        mask, pixels, ink_pixels = hull, int(hull.sum()), border
    else:
        ink_pixels = mask & inked
    r, g, b = (float(v) for v in image[ink_pixels].mean(axis=0))
    hue, saturation, _ = colorsys.rgb_to_hsv(r, g, b)
    colour = _nearest_colour(hue) if saturation >= _MIN_SATURATION else None
    rows = np.nonzero(mask.any(axis=1))[0]
    cols = np.nonzero(mask.any(axis=0))[0]
    height = int(rows[-1] - rows[0] + 1)
    width = int(cols[-1] - cols[0] + 1)
    longest, shortest = max(height, width), min(height, width)
    scores = shape_scores(mask)
    best = max(scores, key=scores.__getitem__)
    fit = scores[best]
    shape: str | None = best
    if (
        fit < MIN_FIT
        or longest > _MAX_ASPECT * shortest
        or longest > _MAX_EXTENT * min(image.shape[:2])
    ):
        shape = None
    return Verdict(
        colour=colour, shape=shape, pixels=pixels, fit=fit, hue=hue, hollow=hollow, style=style
    )
