"""Pictures are made canonical at admission: loaded RGB pictures and L masks, or a clear
InvalidRequestError naming the field, never a failure inside a shared forward."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omni_trio._core.request import SamplingParams
from omni_trio.errors import InvalidRequestError
from omni_trio.runtime.pictures import canonical_pictures


def canonical(image: Any, mask: Any = None) -> SamplingParams:
    return canonical_pictures(SamplingParams(image=image, mask_image=mask))


def test_without_a_picture_nothing_changes_and_canonical_ones_pass_as_they_are() -> None:
    plain = SamplingParams(seed=1)
    assert canonical_pictures(plain) is plain
    picture, mask = Image.new("RGB", (8, 8)), Image.new("L", (8, 8))
    sampling = SamplingParams(image=picture, mask_image=mask)
    assert canonical_pictures(sampling) is sampling


@pytest.mark.parametrize(
    ("picture", "pixel"),
    [
        (Image.new("RGBA", (8, 8), (10, 20, 30, 0)), (255, 255, 255)),  # transparent: white
        (Image.new("RGBA", (8, 8), (10, 20, 30, 255)), (10, 20, 30)),
        (Image.new("LA", (8, 8), (40, 255)), (40, 40, 40)),
        (Image.new("L", (8, 8), 7), (7, 7, 7)),
        (Image.new("1", (8, 8), 1), (255, 255, 255)),
        (Image.new("CMYK", (8, 8), (0, 0, 0, 0)), (255, 255, 255)),
        (Image.fromarray(np.full((8, 8), 1000, np.uint16)), (3, 3, 3)),  # 16 bits: 1000 >> 8
        (np.full((8, 8, 4), (1, 2, 3, 0), np.uint8), (255, 255, 255)),
        (np.full((8, 8, 1), 9, np.uint8), (9, 9, 9)),
        (np.full((8, 16, 3), 5, np.uint8)[:, ::2], (5, 5, 5)),  # not contiguous
    ],
    ids=[
        "rgba-clear",
        "rgba-opaque",
        "la",
        "l",
        "1",
        "cmyk",
        "i16",
        "array-rgba",
        "array-1",
        "array-strided",
    ],
)
def test_pictures_become_loaded_rgb(picture: Any, pixel: tuple[int, int, int]) -> None:
    image = canonical(picture).image
    assert image.mode == "RGB" and image.size == (8, 8)
    assert image.getpixel((0, 0)) == pixel


def test_masks_become_l_by_brightness() -> None:
    sp = canonical(Image.new("RGB", (8, 8)), np.full((8, 8, 3), 255, np.uint8))
    assert sp.mask_image.mode == "L" and sp.mask_image.getpixel((0, 0)) == 255
    sp = canonical(Image.new("RGB", (8, 8)), Image.new("1", (8, 8), 1))
    assert sp.mask_image.getpixel((0, 0)) == 255


def test_a_lazily_opened_picture_is_read_now_and_a_truncated_one_refused() -> None:
    data = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(data, format="PNG")
    good = canonical(Image.open(io.BytesIO(data.getvalue()))).image
    assert good.getpixel((0, 0)) == (1, 2, 3)
    with pytest.raises(InvalidRequestError, match="cannot be read") as info:
        canonical(Image.open(io.BytesIO(data.getvalue()[:-40])))
    assert info.value.param == "image"


@pytest.mark.parametrize(
    ("image", "mask", "param", "message"),
    [
        (Image.new("F", (8, 8)), None, "image", "convert it to 8 bits"),
        (Image.new("I", (8, 8)), None, "image", "convert it to 8 bits"),
        (Image.new("La", (8, 8)), None, "image", "cannot be read"),
        (Image.new("RGB", (8, 8)), Image.new("LAB", (8, 8)), "mask_image", "cannot be read"),
        ("picture.png", None, "image", "PIL image or a uint8 array, not str"),
        (Image.new("RGB", (8, 8)), b"mask", "mask_image", "not bytes"),
    ],
)
def test_pictures_that_cannot_be_converted_are_refused_naming_the_field(
    image: Any, mask: Any, param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        canonical(image, mask)
    assert info.value.param == param


def test_arrays_that_are_not_pictures_are_left_for_validation() -> None:
    odd = np.zeros((8, 8, 2), np.uint8)
    assert canonical(odd).image is odd  # validate_request refuses it with its own message
