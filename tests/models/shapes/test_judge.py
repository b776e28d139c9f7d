"""The judge names the colour and shape of the dataset's own pictures, and refuses noise."""

from __future__ import annotations

import numpy as np

from omni_trio.models.shapes import (
    IMAGE_SIZE,
    foreground_mask,
    judge,
    render_scene,
    sample_scene,
)


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
