"""Decoding uploaded images safely, and reading masks the way OpenAI means them."""

from __future__ import annotations

import io
import struct
import zlib
from functools import cache
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile

from omni_trio.serve.uploads import (
    UploadError,
    as_mask,
    as_rgb,
    decode_upload,
    mask_from_alpha,
)

MAX_PIXELS = 1 << 20


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """Incompressible pixels, so that a cut anywhere falls in the pixel data."""
    bands = len(Image.new(mode, (1, 1)).getbands())
    values = np.random.default_rng(7).integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.frombytes(mode, (width, height), values.tobytes())


def near(pixel: Any, expected: tuple[int, ...], tolerance: int) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected, strict=True))


def pixels(image: Image.Image) -> list[Any]:
    return list(image.get_flattened_data())


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload)
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


@cache
def black_png(width: int, height: int) -> bytes:
    """A valid 1-bit black PNG, written row by row: a 20000x20000 one is ~50 KB and takes
    well under a second and a few MB to write (a decompression bomb: 400 Mpx to decode)."""
    compressor = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the row's bits, all 0 (black)
    idat = []
    for start in range(0, height, 256):
        idat.append(compressor.compress(row * min(256, height - start)))
    idat.append(compressor.flush())
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
        + png_chunk(b"IDAT", b"".join(idat))
        + png_chunk(b"IEND", b"")
    )


def refusal(data: bytes, **kwargs: Any) -> tuple[str, str]:
    kwargs.setdefault("param", "image")
    kwargs.setdefault("max_pixels", MAX_PIXELS)
    with pytest.raises(UploadError) as info:
        decode_upload(data, **kwargs)
    return info.value.code, info.value.param


def decode(data: bytes, **kwargs: Any) -> Image.Image:
    kwargs.setdefault("param", "image")
    kwargs.setdefault("max_pixels", MAX_PIXELS)
    return decode_upload(data, **kwargs)


class PillowReached(BaseException):
    """Raised by a patched-out Pillow; a BaseException, so no ``except Exception`` hides it."""


def forbid_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, Pillow must not open (let alone decode) anything."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PillowReached

    monkeypatch.setattr(Image, "open", refuse)
    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


@pytest.fixture
def no_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_pillow(monkeypatch)


# -- accepted formats ----------------------------------------------------------------------


def test_a_png_decodes_fully_and_detached() -> None:
    source = noise(37, 23, "RGBA")
    image = decode(encode(source, "PNG"), param="image[]")
    assert not isinstance(image, ImageFile.ImageFile)  # loaded and detached from the bytes
    assert (image.mode, image.size) == ("RGBA", (37, 23))
    assert image.tobytes() == source.tobytes()


def test_a_jpeg_decodes() -> None:
    source = Image.new("RGB", (40, 30), (200, 30, 60))
    image = decode(encode(source, "JPEG", quality=95))
    assert (image.mode, image.size) == ("RGB", (40, 30))
    assert near(image.getpixel((20, 15)), (200, 30, 60), 3)


@pytest.mark.parametrize("lossless", [True, False])
def test_a_webp_decodes(lossless: bool) -> None:
    source = Image.new("RGB", (40, 30), (10, 120, 240))
    image = decode(encode(source, "WEBP", lossless=lossless, quality=95))
    assert image.size == (40, 30)
    assert near(image.getpixel((20, 15)), (10, 120, 240), 4)


def test_the_exif_orientation_is_applied() -> None:
    source = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    image = decode(encode(source, "JPEG", exif=exif.tobytes()))
    assert image.size == (20, 40)


def test_a_16_bit_greyscale_png_becomes_8_bits() -> None:
    values = np.full((4, 5), 0x8000, dtype=np.uint16)
    values[0, 0] = 0xFFFF
    image = decode(encode(Image.fromarray(values), "PNG"))
    assert image.mode == "L"
    assert (image.getpixel((0, 0)), image.getpixel((1, 1))) == (255, 128)


def test_an_animated_png_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "PNG", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(data)).n_frames == 2
    image = decode(data)
    assert image.getpixel((4, 4)) == (255, 0, 0)
    assert getattr(image, "n_frames", 1) == 1


def test_an_animated_webp_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert decode(data).convert("RGB").getpixel((4, 4)) == (255, 0, 0)


# -- refused ---------------------------------------------------------------------------------


def test_an_empty_part_is_refused() -> None:
    assert refusal(b"", param="mask") == ("empty_image", "mask")


@pytest.mark.parametrize(
    "data",
    [
        b"hello, not an image",
        bytes(range(256)) * 4,
        b"\x89PNG\r\n\x1a\n",  # a PNG signature and nothing else
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,  # no IHDR
        b"\xff\xd8\xff\xd9",  # a JPEG that ends before any frame
        b"RIFF\x04\x00\x00\x00WEBP",  # a WebP header and nothing else
    ],
)
def test_bytes_that_are_no_image_are_refused(data: bytes) -> None:
    assert refusal(data, param="image[]") == ("invalid_image", "image[]")


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO"])
def test_other_image_formats_are_refused(fmt: str) -> None:
    data = encode(Image.new("RGB", (16, 16), (1, 2, 3)), fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # a real image, just not one we take
    assert refusal(data) == ("unsupported_image_format", "image")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9])
def test_a_truncated_image_is_refused(fmt: str, keep: float) -> None:
    data = encode(noise(64, 64), fmt, **({"quality": 95} if fmt != "PNG" else {}))
    assert decode(data).size == (64, 64)
    assert refusal(data[: int(len(data) * keep)]) == ("invalid_image", "image")


@pytest.mark.parametrize("cut", [1, 12, 20])
def test_a_png_cut_at_its_end_is_refused(cut: int) -> None:
    # Pillow alone accepts these (the pixels are complete; IEND or the checksum is missing).
    data = encode(noise(64, 64), "PNG")
    assert refusal(data[:-cut]) == ("invalid_image", "image")


def test_a_jpeg_without_its_end_marker_is_refused() -> None:
    data = encode(noise(64, 64), "JPEG", quality=95)
    assert data.endswith(b"\xff\xd9")
    assert refusal(data[:-2]) == ("invalid_image", "image")


def test_a_corrupt_png_is_refused() -> None:
    data = bytearray(encode(noise(64, 64), "PNG"))
    data[len(data) // 2] ^= 0xFF  # inside IDAT: its CRC no longer matches
    assert refusal(bytes(data)) == ("invalid_image", "image")


def test_a_decompression_bomb_is_refused_without_decoding(no_pillow: None) -> None:
    bomb = black_png(20000, 20000)
    assert len(bomb) < 100_000
    assert refusal(bomb, max_pixels=MAX_PIXELS) == ("image_too_large", "image")


def test_the_bomb_builder_makes_real_pngs() -> None:
    image = decode(black_png(300, 200))  # the same builder, small enough to decode
    assert image.size == (300, 200)
    assert image.getextrema() == (0, 0)


def test_a_webp_bomb_is_refused_before_pillow(no_pillow: None) -> None:
    # The header of a 16000x16000 extended WebP: Pillow's decoder would allocate ~1 GB.
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4
    vp8x += (16000 - 1).to_bytes(3, "little") * 2
    data = b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x
    assert refusal(data) == ("image_too_large", "image")


def test_a_jpeg_bomb_is_refused_before_pillow(no_pillow: None) -> None:
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, 60000, 60000, 1) + b"\x01\x11\x00"
    data = b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 4) + b"JF" + sof + b"\xff\xd9"
    assert refusal(data) == ("image_too_large", "image")


@pytest.mark.parametrize(
    ("fmt", "mode", "options"),
    [
        ("PNG", "RGB", {}),
        ("JPEG", "RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 64}),
        ("WEBP", "RGB", {"lossless": False}),  # VP8
        ("WEBP", "RGB", {"lossless": True}),  # VP8L
        ("WEBP", "RGBA", {"lossless": False}),  # VP8X (alpha)
    ],
)
def test_the_pixel_and_side_limits_are_inclusive_and_read_before_pillow(
    fmt: str, mode: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = encode(Image.new(mode, (37, 23)), fmt, **options)
    assert decode(data, max_pixels=37 * 23, max_side=37).size == (37, 23)
    forbid_pillow(monkeypatch)  # the size comes from our reading of the header
    assert refusal(data, max_pixels=37 * 23 - 1) == ("image_too_large", "image")
    assert refusal(data, max_side=36) == ("image_too_large", "image")


def test_truncation_cannot_be_hidden_by_the_global_pillow_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode(encode(noise(8, 8), "PNG"))


# -- RGB and masks ---------------------------------------------------------------------------


def test_as_rgb_composites_transparency_on_white() -> None:
    image = Image.new("RGBA", (3, 1))
    image.putpixel((0, 0), (255, 0, 0, 0))  # transparent red: hidden, so white
    image.putpixel((1, 0), (0, 0, 0, 128))  # half-transparent black: grey
    image.putpixel((2, 0), (10, 20, 30, 255))  # opaque: as is
    rgb = as_rgb(image)
    assert rgb.mode == "RGB"
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert all(abs(v - 127) <= 1 for v in rgb.getpixel((1, 0)))
    assert rgb.getpixel((2, 0)) == (10, 20, 30)


def test_as_rgb_of_a_palette_image_with_a_transparent_index() -> None:
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0])
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 0
    assert pixels(as_rgb(image)) == [(255, 255, 255), (255, 0, 0)]


def test_as_rgb_of_an_opaque_image_is_a_copy() -> None:
    image = Image.new("L", (2, 2), 9)
    rgb = as_rgb(image)
    assert (rgb.mode, rgb.getpixel((0, 0))) == ("RGB", (9, 9, 9))
    assert rgb is not image


def test_a_transparent_mask_marks_its_fully_transparent_pixels() -> None:
    mask = Image.new("RGBA", (3, 1), (0, 0, 0, 255))
    mask.putpixel((0, 0), (0, 0, 0, 0))
    mask.putpixel((1, 0), (255, 255, 255, 128))  # partly transparent: kept (OpenAI: fully)
    out = as_mask(mask, size=(3, 1))
    assert out.mode == "L"
    assert pixels(out) == [255, 0, 0]


def test_a_mask_without_transparency_is_read_by_luminance() -> None:
    grey = Image.new("L", (3, 1))
    grey.putdata([0, 255, 100])
    assert pixels(as_mask(grey, size=(3, 1))) == [0, 255, 100]
    opaque = Image.merge("RGBA", [*grey.convert("RGB").split(), Image.new("L", (3, 1), 255)])
    assert pixels(as_mask(opaque, size=(3, 1))) == [0, 255, 100]


def test_a_mask_of_another_size_is_refused() -> None:
    with pytest.raises(UploadError) as info:
        as_mask(Image.new("L", (8, 9)), size=(9, 8))
    assert (info.value.param, info.value.code) == ("mask", "mask_size_mismatch")


def test_mask_from_alpha() -> None:
    image = Image.new("RGBA", (2, 2), (5, 5, 5, 255))
    assert mask_from_alpha(image) is None  # opaque
    image.putpixel((1, 0), (5, 5, 5, 1))
    assert mask_from_alpha(image) is None  # nearly transparent is not transparent
    image.putpixel((0, 1), (5, 5, 5, 0))
    mask = mask_from_alpha(image)
    assert mask is not None and mask.mode == "L"
    assert pixels(mask) == [0, 0, 255, 0]
    assert mask_from_alpha(Image.new("RGB", (2, 2))) is None


def test_mask_from_alpha_of_an_uploaded_png_with_a_transparent_index() -> None:
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0])
    image.putpixel((0, 0), 1)
    decoded = decode(encode(image, "PNG", transparency=0))
    mask = mask_from_alpha(decoded)
    assert mask is not None and pixels(mask) == [0, 255]
    assert pixels(as_rgb(decoded)) == [(255, 0, 0), (255, 255, 255)]
