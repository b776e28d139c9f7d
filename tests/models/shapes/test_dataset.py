"""The procedural dataset: captions say what the pixels show, deterministically per seed."""

from __future__ import annotations

import colorsys
import dataclasses
import math

import numpy as np
import pytest

from omni_trio.models.shapes import (
    COLOURS,
    IMAGE_SIZE,
    SHAPES,
    SIZES,
    STYLES,
    Scene,
    article,
    caption,
    make_batch,
    outline_mask,
    render_scene,
    sample_scene,
    shape_mask,
)
from omni_trio.models.shapes._dataset import OUTLINE_WIDTH, outline_width


def _scenes(seed: int, n: int) -> list[Scene]:
    rng = np.random.default_rng(seed)
    return [sample_scene(rng) for _ in range(n)]


def _hue(rgb: np.ndarray) -> float:
    return colorsys.rgb_to_hsv(*(float(c) for c in rgb))[0]


def _hue_distance(a: float, b: float) -> float:
    d = abs(a - b) % 1.0
    return min(d, 1.0 - d)


def test_a_batch_is_deterministic_per_seed() -> None:
    a_images, a_captions, a_scenes = make_batch(np.random.default_rng(7), 16)
    b_images, b_captions, b_scenes = make_batch(np.random.default_rng(7), 16)
    c_images, _, _ = make_batch(np.random.default_rng(8), 16)
    assert np.array_equal(a_images, b_images)
    assert a_captions == b_captions and a_scenes == b_scenes
    assert not np.array_equal(a_images, c_images)
    assert a_images.shape == (16, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert a_images.dtype == np.float32
    assert a_images.min() >= -1.0 and a_images.max() <= 1.0


def test_every_colour_shape_and_size_is_drawn() -> None:
    scenes = _scenes(0, 400)
    assert {s.colour for s in scenes} == set(COLOURS)
    assert {s.shape for s in scenes} == set(SHAPES)
    assert {s.size for s in scenes} == set(SIZES)
    assert len(COLOURS) >= 6 and set(SHAPES) >= {"circle", "square", "triangle"}


def test_captions_name_the_scene() -> None:
    rng = np.random.default_rng(1)
    _, captions, scenes = make_batch(rng, 200)
    for text, scene in zip(captions, scenes, strict=True):
        words = text.split()
        assert words[0] == article(words[1])
        assert scene.colour in words and scene.shape in words
        assert words.index(scene.colour) + 1 == words.index(scene.shape)
        other_colours = set(COLOURS) - {scene.colour}
        other_shapes = set(SHAPES) - {scene.shape}
        assert not other_colours & set(words) and not other_shapes & set(words)
        sizes = {"small", "medium", "large"} & set(words)
        assert sizes <= {scene.size} and "medium" not in sizes
    assert any("white background" in c for c in captions)
    assert any(c.split()[1] in ("small", "large") for c in captions)
    assert (article("orange"), article("red")) == ("an", "a")


def test_the_shapes_pixels_have_the_named_colour_and_the_rest_is_white() -> None:
    for scene in _scenes(2, 60):
        image = render_scene(scene)
        alpha = shape_mask(scene.shape, scene.cx, scene.cy, scene.radius)
        inside = image[alpha == 1.0]
        outside = image[alpha == 0.0]
        assert len(inside) >= 20
        assert np.allclose(outside, 1.0)
        assert np.allclose(inside, np.asarray(scene.rgb) / 255.0, atol=1e-6)
        named = np.asarray(COLOURS[scene.colour]) / 255.0
        assert _hue_distance(_hue(inside.mean(axis=0)), _hue(named)) < 0.03
        assert all(abs(a - b) <= 12 for a, b in zip(scene.rgb, COLOURS[scene.colour], strict=True))


def test_the_shapes_fill_their_boxes_as_promised() -> None:
    size = 64  # a large canvas: pixelisation errors are small
    for shape, expected in (("square", 1.0), ("circle", math.pi / 4), ("triangle", 0.5)):
        area = shape_mask(shape, 32.0, 32.0, 20.0, size).sum()
        assert area / (40.0 * 40.0) == pytest.approx(expected, abs=0.01), shape


def test_shapes_stay_inside_the_picture_and_sizes_keep_their_ranges() -> None:
    for scene in _scenes(3, 300):
        lo, hi = SIZES[scene.size]
        assert lo <= scene.radius <= hi
        assert scene.radius < scene.cx < IMAGE_SIZE - scene.radius
        assert scene.radius < scene.cy < IMAGE_SIZE - scene.radius
        alpha = shape_mask(scene.shape, scene.cx, scene.cy, scene.radius)
        expected = {"square": 4.0, "circle": math.pi, "triangle": 2.0}[scene.shape]
        assert alpha.sum() == pytest.approx(expected * scene.radius**2, rel=0.08)


def test_fixed_attributes_and_unknown_names() -> None:
    rng = np.random.default_rng(4)
    scene = sample_scene(rng, shape="triangle", colour="purple", size="small")
    assert (scene.shape, scene.colour, scene.size) == ("triangle", "purple", "small")
    assert "purple triangle" in caption(scene, rng)
    for bad in ({"shape": "hexagon"}, {"colour": "teal"}, {"size": "huge"}):
        with pytest.raises(ValueError, match="unknown"):
            sample_scene(rng, **bad)
    with pytest.raises(ValueError, match="unknown shape"):
        shape_mask("hexagon", 1, 1, 1)


def test_an_outline_is_the_border_of_the_filled_shape_in_its_colour() -> None:
    for scene in _scenes(5, 90):
        outlined = dataclasses.replace(scene, style="outline")
        image = render_scene(outlined)
        filled = shape_mask(scene.shape, scene.cx, scene.cy, scene.radius)
        border = outline_mask(scene.shape, scene.cx, scene.cy, scene.radius)
        assert np.all(border <= filled + 1e-6)  # inside the shape: the same extent
        assert np.allclose(image[filled == 0.0], 1.0)
        ring = image[border == 1.0]
        assert len(ring) >= 8
        assert np.allclose(ring, np.asarray(scene.rgb) / 255.0, atol=1e-6)
        # The inside is the background: some pixels of even a small triangle are left white.
        hollow = (filled == 1.0) & (border == 0.0)
        assert hollow.sum() >= 3, scene
        assert np.allclose(image[hollow], 1.0)
        width = outline_width(scene.shape, scene.radius)
        assert 1.0 <= width <= OUTLINE_WIDTH


def test_the_style_changes_pixels_only() -> None:
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    filled_images, filled_captions, filled_scenes = make_batch(rng_a, 24)
    outline_images, outline_captions, outline_scenes = make_batch(rng_b, 24, style="outline")
    assert outline_captions == filled_captions  # no style word: the adapter alone draws it
    assert [dataclasses.replace(s, style="filled") for s in outline_scenes] == filled_scenes
    assert {s.style for s in filled_scenes} == {"filled"}
    assert {s.style for s in outline_scenes} == {"outline"}
    assert (outline_images >= filled_images - 1e-6).all()  # an outline only removes ink
    assert not np.array_equal(outline_images, filled_images)
    assert STYLES == ("filled", "outline")
    with pytest.raises(ValueError, match="unknown style"):
        make_batch(np.random.default_rng(0), 1, style="dotted")
    with pytest.raises(ValueError, match="unknown shape"):
        outline_width("hexagon", 5.0)
