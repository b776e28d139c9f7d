"""Uploaded images, decoded safely: the ``image`` and ``mask`` parts of
``POST /v1/images/edits`` and ``/v1/images/variations``.

Pure and synchronous (no trio, no I/O), but CPU-bound: :func:`decode_upload` decodes a whole
image, so the app runs it in a thread (``trio.to_thread.run_sync``).  It changes no global
Pillow state (``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``), so calls in
several threads at once are safe.

Bounds, checked in this order (each an :class:`UploadError` with ``param`` the part's name):

- an empty part [``empty_image``];
- the format, told by the file's signature, not by its ``Content-Type`` or filename: PNG, JPEG
  or WebP, what OpenAI accepts [``unsupported_image_format`` for another known image format
  (GIF, BMP, TIFF, ICO, HEIC/AVIF...), ``invalid_image`` for bytes that are no image];
- the size, read from the file's header by this module *before* Pillow sees the file (WebP's
  decoder allocates its canvas when it opens a file, so Pillow's lazy ``Image.open`` is not
  lazy enough): ``width * height <= max_pixels`` and, when given, both sides ``<= max_side``
  [``image_too_large``].  A decompression bomb (a 20000x20000 PNG of a few KB) is refused
  without decoding a pixel.  The size Pillow reads is checked again.
- the decode itself: the whole image is loaded, and a truncated one (pixel data cut short, a
  PNG without its ``IEND`` chunk, a JPEG without its end) or a corrupt one is refused
  [``invalid_image``].

Multi-frame files (animated PNG or WebP, the multi-picture JPEGs (MPO) that phone cameras
write) are *accepted*, and only their first frame is decoded and returned: that frame is
what a viewer shows first, and for MPO it is the photo itself.  A JPEG's EXIF orientation is
applied, so the pixels are upright as viewers show them.  A 16-bit greyscale PNG is reduced to
8 bits (``L``, or ``LA`` when it has a transparent colour).

Masks follow OpenAI's convention: the *fully transparent* pixels (alpha 0) of the mask, or of
the image itself when no mask is sent (:func:`mask_from_alpha`), are the ones to repaint.
:func:`as_mask` returns mode ``L`` with 255 where to repaint (diffusers' convention); a mask
with no transparency at all (no alpha channel, or all opaque) is read by its luminance
instead (white = repaint, grey kept as sent).  :func:`as_rgb` composites any transparency on
white, so what a transparent pixel hid never reaches the model.
"""

from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image, ImageFile, ImageOps

from ..runtime.pictures import on_white

__all__ = [
    "FORMATS",
    "UploadError",
    "as_mask",
    "as_rgb",
    "decode_upload",
    "mask_from_alpha",
]

FORMATS = ("PNG", "JPEG", "WEBP")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xae\x42\x60\x82"
_JPEG_SOI = b"\xff\xd8\xff"
# JPEG start-of-frame markers: C0..CF but DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length: TEM, RST0..7 (SOI and EOI are handled apart).
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
# Signatures of image formats we recognise only to refuse them by name.
_OTHER_FORMATS = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"qoif", "QOI"),
)
_TRANSPARENT_TO_255 = [255] + [0] * 255  # lookup table: alpha 0 -> 255, any other -> 0


class UploadError(ValueError):
    """An uploaded image that is not acceptable; answered as a 400.

    ``param`` names the form part (``image``, ``image[]``, ``mask``); ``code`` is a short
    machine-readable reason (see the module docstring).
    """

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def decode_upload(
    data: bytes, *, param: str, max_pixels: int, max_side: int | None = None
) -> Image.Image:
    """The image in ``data``, fully decoded and detached from it (first frame only).

    Checks what the module docstring lists, in that order, and raises :class:`UploadError`
    (with ``param``) at the first failure; never decodes pixels before the size is known to
    be within ``max_pixels`` and ``max_side``.  The image comes in the mode Pillow decodes
    (``RGB``, ``RGBA``, ``L``, ``LA``, ``P``, ``1``, ``CMYK``...): see :func:`as_rgb` and
    :func:`as_mask`.  Pillow's own process-wide bomb limit (``Image.MAX_IMAGE_PIXELS``, about
    89 Mpx, left as it is) still applies, so ``max_pixels`` should stay below it.
    Raises ``RuntimeError`` if something in the process has set
    ``ImageFile.LOAD_TRUNCATED_IMAGES``, under which truncation could not be detected.
    """
    if not data:
        raise UploadError(f"{param!r} is an empty file", param=param, code="empty_image")
    fmt = _sniff_format(data, param)
    width, height = _header_size(data, fmt, param)
    _check_size(width, height, param=param, max_pixels=max_pixels, max_side=max_side)
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: uploads are refused")
    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as opened:
            _check_size(*opened.size, param=param, max_pixels=max_pixels, max_side=max_side)
            opened.load()  # the first frame: an animation is never seeked
            image = _normalise(opened)
    except UploadError:
        raise
    except Image.DecompressionBombError:
        raise _too_large(param, f"{param!r} is too large") from None
    except MemoryError:
        raise
    except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, struct.error...
        raise UploadError(
            f"{param!r} is not a valid {fmt} image ({type(exc).__name__})",
            param=param,
            code="invalid_image",
        ) from None
    _check_size(*image.size, param=param, max_pixels=max_pixels, max_side=max_side)
    return image


def as_rgb(image: Image.Image) -> Image.Image:
    """A new ``RGB`` copy of ``image``; any transparency is composited on white (as the
    engine makes every picture at admission, :func:`omni_trio.runtime.pictures.on_white`)."""
    return on_white(image)


def as_mask(image: Image.Image, *, size: tuple[int, int]) -> Image.Image:
    """The mask ``image`` as mode ``L``: 255 where to repaint, 0 where to keep.

    With transparency (some pixel not fully opaque), the fully transparent pixels are 255 and
    all others 0 (OpenAI's convention).  Without (no alpha channel, or every pixel opaque),
    its luminance is the mask (white = repaint, diffusers' convention; grey kept).  Raises
    :class:`UploadError` ``mask_size_mismatch`` (``param="mask"``) unless its size is
    ``size``, the image's.
    """
    if image.size != tuple(size):
        raise UploadError(
            f"mask is {image.width}x{image.height} but the image is {size[0]}x{size[1]}",
            param="mask",
            code="mask_size_mismatch",
        )
    alpha = _alpha(image)
    if alpha is not None and alpha.histogram()[255] < alpha.width * alpha.height:
        return alpha.point(_TRANSPARENT_TO_255)
    return image.convert("L")


def mask_from_alpha(image: Image.Image) -> Image.Image | None:
    """The mask that ``image``'s own transparency makes (mode ``L``, 255 where alpha is 0),
    or ``None`` when no pixel is fully transparent (no alpha channel included): OpenAI edits
    an image sent without a mask where it is transparent."""
    alpha = _alpha(image)
    if alpha is None or alpha.histogram()[0] == 0:
        return None
    return alpha.point(_TRANSPARENT_TO_255)


def _alpha(image: Image.Image) -> Image.Image | None:
    """The alpha channel (mode ``L``), or ``None`` when ``image`` has no transparency data."""
    if not image.has_transparency_data:
        return None
    return image.convert("RGBA").getchannel("A")


def _too_large(param: str, message: str) -> UploadError:
    return UploadError(message, param=param, code="image_too_large")


def _check_size(
    width: int, height: int, *, param: str, max_pixels: int, max_side: int | None
) -> None:
    if width < 1 or height < 1:
        raise UploadError(f"{param!r} has no pixels", param=param, code="invalid_image")
    if width * height > max_pixels:
        raise _too_large(param, f"{param!r} is {width}x{height}, more than {max_pixels} pixels")
    if max_side is not None and max(width, height) > max_side:
        raise _too_large(
            param, f"{param!r} is {width}x{height}, a side longer than {max_side} pixels"
        )


def _sniff_format(data: bytes, param: str) -> str:
    if data.startswith(_PNG_SIGNATURE):
        return "PNG"
    if data.startswith(_JPEG_SOI):
        return "JPEG"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    other = next((name for sig, name in _OTHER_FORMATS if data.startswith(sig)), None)
    if other is None and data[4:8] == b"ftyp" and data[8:12] in (b"heic", b"heix", b"avif"):
        other = "HEIC/AVIF"
    if other is not None:
        raise UploadError(
            f"{param!r} is a {other} image; PNG, JPEG and WebP are supported",
            param=param,
            code="unsupported_image_format",
        )
    raise UploadError(
        f"{param!r} is not an image (PNG, JPEG or WebP)", param=param, code="invalid_image"
    )


def _header_size(data: bytes, fmt: str, param: str) -> tuple[int, int]:
    """``(width, height)`` from the file's header; :class:`UploadError` when it has none."""
    size = {"PNG": _png_size, "JPEG": _jpeg_size, "WEBP": _webp_size}[fmt](data)
    if size is None:
        raise UploadError(
            f"{param!r} is not a valid {fmt} image (bad or truncated header)",
            param=param,
            code="invalid_image",
        )
    return size


def _png_size(data: bytes) -> tuple[int, int] | None:
    # IHDR is the first chunk: length 13, type, width, height (big-endian).
    if len(data) < 24 or data[8:16] != b"\x00\x00\x00\x0dIHDR":
        return None
    if not data.endswith(_PNG_IEND):
        return None  # truncated (Pillow would accept pixels complete up to a missing end)
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    # Walk the marker segments from SOI to the first start-of-frame.
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or SOS before any frame
            return None
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if length < 2:
            return None
        if marker in _JPEG_SOF:
            if length < 7 or pos + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return width, height
        pos += 2 + length
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    # RFC 9649: RIFF size, then VP8 (lossy), VP8L (lossless) or VP8X (extended) first.
    if len(data) < 30 or struct.unpack("<I", data[4:8])[0] + 8 > len(data):
        return None  # too short, or cut before the RIFF size says it ends
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    if chunk == b"VP8L":
        if data[20] != 0x2F:
            return None
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    return None


def _normalise(image: Image.Image) -> Image.Image:
    """A new image from a loaded one (so detached from its file): upright, 8 bits a channel."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(image).astype(np.int64)
        grey = Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8))
        key = image.info.get("transparency")
        if isinstance(key, int):
            opaque = np.where(values == key, 0, 255).astype(np.uint8)
            grey.putalpha(Image.fromarray(opaque))
        return grey
    return ImageOps.exif_transpose(image)  # always a new image, turned or not
