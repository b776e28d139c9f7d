"""The judge names the colour, shape and style of the dataset's own pictures, and refuses
noise."""

from __future__ import annotations

import dataclasses

import numpy as np

from omni_trio.models.shapes import (
    IMAGE_SIZE,
    STYLES,
    foreground_mask,
    judge,
    render_scene,
    sample_scene,
)
from omni_trio.models.shapes._judge import MIN_HOLLOW


def test_the_judge_agrees_with_the_dataset() -> None:
    rng = np.random.default_rng(11)
    scenes = [sample_scene(rng) for _ in range(150)]
    verdicts = [judge(render_scene(scene)) for scene in scenes]
    colours = sum(v.colour == s.colour for v, s in zip(verdicts, scenes, strict=True))
    shapes = sum(v.shape == s.shape for v, s in zip(verdicts, scenes, strict=True))
    assert colours == len(scenes)
    assert shapes >= 0.98 * len(scenes)


def test_a_white_picture_has_no_answer() -> None:
    verdict = judge(np.ones((IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))
    assert verdict.colour is None and verdict.shape is None and verdict.pixels == 0


def test_noise_is_no_shape() -> None:
    noise = np.random.default_rng(0).random((IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    assert judge(noise).shape is None


def test_a_grey_shape_is_no_colour() -> None:
    scene = sample_scene(np.random.default_rng(1), shape="square", size="large")
    grey = render_scene(scene).mean(axis=-1, keepdims=True).repeat(3, axis=-1)
    verdict = judge(grey)
    assert verdict.colour is None and verdict.shape == "square"


def test_specks_away_from_the_shape_are_ignored() -> None:
    scene = sample_scene(np.random.default_rng(2), shape="circle", colour="blue", size="small")
    image = render_scene(scene)
    speck = (0, 0) if scene.cx > 16 or scene.cy > 16 else (IMAGE_SIZE - 1, IMAGE_SIZE - 1)
    image[speck] = 0.0
    assert not foreground_mask(image)[speck]
    verdict = judge(image)
    assert (verdict.colour, verdict.shape) == ("blue", "circle")


def test_the_judge_tells_outlined_from_filled_and_still_names_colour_and_shape() -> None:
    rng = np.random.default_rng(12)
    scenes = [sample_scene(rng) for _ in range(150)]
    for style in STYLES:
        verdicts = [judge(render_scene(dataclasses.replace(s, style=style))) for s in scenes]
        assert [v.style for v in verdicts] == [style] * len(scenes)  # told apart 100 %
        colours = sum(v.colour == s.colour for v, s in zip(verdicts, scenes, strict=True))
        shapes = sum(v.shape == s.shape for v, s in zip(verdicts, scenes, strict=True))
        assert colours == len(scenes), style
        assert shapes >= 0.98 * len(scenes), style
        hollow = [v.hollow for v in verdicts]
        if style == "filled":
            assert max(hollow) == 0.0
        else:
            assert min(hollow) >= MIN_HOLLOW


def test_an_outline_is_judged_as_the_shape_it_bounds() -> None:
    scene = sample_scene(np.random.default_rng(3), shape="triangle", colour="yellow", size="large")
    outlined = render_scene(dataclasses.replace(scene, style="outline"))
    filled = render_scene(scene)
    assert np.array_equal(foreground_mask(outlined), foreground_mask(filled))
    verdict = judge(outlined)
    assert (verdict.colour, verdict.shape, verdict.style) == ("yellow", "triangle", "outline")
    # The colour is the border's, not washed out by the white inside.
    assert abs(verdict.hue - judge(filled).hue) < 0.01


def test_a_picture_without_a_foreground_has_no_style() -> None:
    verdict = judge(np.ones((IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))
    assert verdict.style is None and verdict.hollow == 0.0


def test_a_gap_in_the_border_keeps_the_outline_and_a_notch_is_no_hole() -> None:
    scene = sample_scene(np.random.default_rng(4), shape="square", colour="green", size="large")
    outlined = render_scene(dataclasses.replace(scene, style="outline"))
    top, left = int(scene.cy - scene.radius) + 1, int(scene.cx)
    gapped = outlined.copy()
    gapped[top - 2 : top + 3, left : left + 2] = 1.0  # a 2-pixel gap through the top side
    verdict = judge(gapped)
    assert (verdict.colour, verdict.shape, verdict.style) == ("green", "square", "outline")
    # Two filled triangles touching tip to base: the notches beside the neck have no ink,
    # but they are not enclosed, so the picture is filled.
    upper = sample_scene(np.random.default_rng(5), shape="triangle", colour="red", size="small")
    upper = dataclasses.replace(upper, radius=5.0, cx=16.0, cy=9.0)
    lower = dataclasses.replace(upper, cy=18.0)
    stacked = np.minimum(render_scene(upper), render_scene(lower))
    assert judge(stacked).style == "filled"
