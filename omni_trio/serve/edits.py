"""``POST /v1/images/edits`` and ``POST /v1/images/variations``: OpenAI's multipart image
endpoints, parsed into the :class:`~omni_trio.serve.images.ParsedRequest` a generation is.

Both take ``multipart/form-data`` (:mod:`omni_trio.serve.multipart`; what the official SDK's
``client.images.edit(...)`` and ``create_variation(...)`` send):

- ``image`` (or ``image[]``): exactly one picture, PNG, JPEG or WebP
  (:mod:`omni_trio.serve.uploads`: at most ``max_upload_pixels``; a second one is a 400
  ``too_many_images``: the models served here start from one picture).  Transparency is
  composited on white.
- edits only: ``prompt`` (required), ``mask`` (same size as the image; its fully transparent
  pixels, or without transparency its white ones, are repainted).  Without a mask, an image
  whose own alpha is 0 somewhere is repainted there (OpenAI's rule); an opaque image is
  edited as a whole (image-to-image).  A mask that marks nothing is a 400 ``empty_mask``.
- the text fields of ``POST /v1/images/generations`` (``n``, ``size``, ``response_format``,
  ``output_format``, ``output_compression``, ``stream`` and ``partial_images`` for edits,
  the diffusion extensions ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``,
  ``seed``, ``priority``, ``timeout``), each sent as form text and read as its JSON type
  (``"3"`` an integer, ``"true"`` a boolean), plus ``strength`` (in ``(0, 1]``; default 0.8
  for image-to-image and variations, 1.0 for inpainting).  Variations take no prompt, mask or
  stream.

``size`` defaults to the picture's own, rounded down to multiples of 8 (within
``max_pixels``: a bigger picture needs an explicit ``size``); the picture is resized to it.
Streaming events are named ``image_edit.*`` (``image_edit.partial_image``,
``image_edit.completed``), as OpenAI names them.  Every refusal is an :class:`ApiError`
with the envelope and the field in ``param``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from .api_spec import EDIT_FIELDS, GENERATION_FIELDS, NOT_FOR_VARIATIONS
from .images import ApiError, ParsedRequest, ServeLimits, parse_generation_request
from .multipart import MultipartError, Part, fields
from .uploads import UploadError, as_mask, as_rgb, decode_upload, mask_from_alpha

__all__ = ["form_digest", "parse_edit_form"]

_SPECS = (*GENERATION_FIELDS, *EDIT_FIELDS)
_INT_FIELDS = frozenset(f.name for f in _SPECS if f.type == "integer")
_NUMBER_FIELDS = frozenset(f.name for f in _SPECS if f.type == "number")
_BOOL_FIELDS = frozenset(f.name for f in _SPECS if f.type == "boolean")
# What a variation may not be sent (OpenAI's create_variation has none of them).
_NOT_FOR_VARIATIONS = frozenset(NOT_FOR_VARIATIONS)
_IMAGE_NAMES = ("image", "image[]")
# What JSON would carry: no spaces, underscores, signs other than "-", "nan" or "inf".
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_NUMBER = re.compile(r"-?[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?")


def _bad(param: str | None, message: str, code: str) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _typed(name: str, text: str) -> Any:
    """A form field's text as the JSON value the generations body would carry."""
    if name in _BOOL_FIELDS:
        if text in ("true", "false"):
            return text == "true"
        raise _bad(name, f"{name} must be true or false, got {text!r}", "invalid_type")
    if name in _INT_FIELDS:
        if _INTEGER.fullmatch(text) is None:
            raise _bad(name, f"{name} must be an integer, got {text!r}", "invalid_type")
        return int(text)
    if name in _NUMBER_FIELDS:
        if _NUMBER.fullmatch(text) is None:
            raise _bad(name, f"{name} must be a number, got {text!r}", "invalid_type")
        value = float(text)
        if not math.isfinite(value):
            raise _bad(name, f"{name} must be a finite number", "invalid_value")
        return value
    if name == "lora" and text.lstrip().startswith(("[", "{")):
        try:  # a list or an object, as the generations body would carry it
            return json.loads(text)
        except ValueError:
            raise _bad(name, "lora is not valid JSON", "invalid_json") from None
    return text


def _strength(body: dict[str, Any]) -> float | None:
    value = body.pop("strength", None)
    if value is not None and not 0 < value <= 1:
        raise _bad("strength", f"strength must be in (0, 1], got {value}", "invalid_value")
    return value


def _upload(part: Part, param: str, limits: ServeLimits) -> Any:
    try:
        return decode_upload(part.data, param=param, max_pixels=limits.max_upload_pixels)
    except UploadError as exc:
        raise _bad(exc.param or param, exc.message, exc.code) from None


def _files(parts: Sequence[Part], variation: bool) -> tuple[Part, Part | None]:
    images: list[Part] = []
    mask: Part | None = None
    for part in parts:
        if part.name in _IMAGE_NAMES:
            images.append(part)
        elif part.name == "mask" and not variation:
            if mask is not None:
                raise _bad("mask", "mask was sent more than once", "duplicate_field")
            mask = part
        else:
            raise _bad(
                part.name,
                f"Unrecognized request argument supplied: {part.name}",
                "unknown_parameter",
            )
    if not images:
        raise _bad(
            "image", "image is required (a PNG, JPEG or WebP file)", "missing_required_parameter"
        )
    if len(images) > 1:
        raise _bad(
            "image",
            f"{len(images)} images were sent; this server edits one picture per request "
            "(send each in a request of its own)",
            "too_many_images",
        )
    return images[0], mask


def parse_edit_form(
    parts: Sequence[Part],
    *,
    limits: ServeLimits,
    default_model: str,
    variation: bool = False,
    adapters: Collection[str] = (),
) -> ParsedRequest:
    """A multipart edit (or, with ``variation``, variation) request as the generation it runs
    (see the module docstring).  Blocking and CPU-bound (it decodes the pictures): run it in
    a thread.  Raises :class:`ApiError`."""
    files = [part for part in parts if part.is_file]
    try:
        text = fields(part for part in parts if not part.is_file)
    except MultipartError as exc:
        raise _bad(exc.param, exc.message, exc.code) from None
    if variation:
        for name in sorted(_NOT_FOR_VARIATIONS & set(text)):
            raise _bad(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
    if "mask" in text:
        raise _bad("mask", "mask must be a file part (an image)", "invalid_type")
    for name in text:
        if name in _IMAGE_NAMES:
            raise _bad(name, f"{name} must be a file part (an image)", "invalid_type")
    body: dict[str, Any] = {name: _typed(name, value) for name, value in text.items()}
    strength = _strength(body)
    image_part, mask_part = _files(files, variation)
    if variation:
        body["prompt"] = "-"  # parse_generation_request needs one; a variation has none
    parsed = parse_generation_request(
        body, limits=limits, default_model=default_model, adapters=adapters
    )
    image = _upload(image_part, "image", limits)
    picture = as_rgb(image)
    mask = None
    if mask_part is not None:
        try:
            mask = as_mask(_upload(mask_part, "mask", limits), size=picture.size)
        except UploadError as exc:
            raise _bad(exc.param or "mask", exc.message, exc.code) from None
    elif not variation:
        mask = mask_from_alpha(image)
    if mask is not None and int(np.asarray(mask).max()) < 128:  # diffusers binarises at 0.5
        raise _bad(
            "mask",
            "the mask marks nothing to repaint (no fully transparent pixel, and no white one)",
            "empty_mask",
        )
    params = parsed.params
    if params.width is None or params.height is None:
        width, height = picture.size[0] // 8 * 8, picture.size[1] // 8 * 8
        if width < 8 or height < 8:
            raise _bad(
                "image",
                f"image is {picture.size[0]}x{picture.size[1]}; too small",
                "image_too_small",
            )
        if width * height > limits.max_pixels:
            raise _bad(
                "size",
                f"image is {picture.size[0]}x{picture.size[1]} ({width * height} pixels at "
                f"{width}x{height}); results are at most {limits.max_pixels} pixels: pass a "
                "smaller size, the picture is resized to it",
                "invalid_value",
            )
        params = params.replace(width=width, height=height)
    params = params.replace(image=picture, mask_image=mask, strength=strength)
    return dataclasses.replace(
        parsed,
        prompt="" if variation else parsed.prompt,
        params=params,
        event_prefix="image_edit",
    )


def form_digest(parts: Sequence[Part]) -> str:
    """The fingerprint of a multipart body for ``Idempotency-Key``: its fields and files in
    order, not the boundary (which a client picks anew for every send)."""
    digest = hashlib.sha256()
    for part in parts:  # a file's name and type do not count: its bytes say what it is
        name = part.name.encode("utf-8", "surrogatepass")
        digest.update(len(name).to_bytes(8, "big") + name)
        digest.update(len(part.data).to_bytes(8, "big") + part.data)
    return digest.hexdigest()
