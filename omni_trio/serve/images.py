"""The OpenAI Images API, our side of it: request parsing, image encoding, response bodies,
and the in-memory store behind ``response_format="url"``.

Pure and synchronous (no trio, no I/O): :func:`parse_generation_request` turns a decoded JSON
body into a :class:`ParsedRequest` or raises :class:`ApiError` naming the offending field;
:func:`encode_image` turns one image into PNG/JPEG/WebP bytes, carrying the recipe that
:func:`image_metadata` writes down; :class:`ImageStore` keeps encoded images for a while under
unguessable ids.

Fields of ``POST /v1/images/generations`` (all optional but ``prompt``; ``null`` means
"default")::

    prompt              str, 1..max_prompt_chars
    model               the served model name (anything else: 404 model_not_found)
    n                   int 1..max_n
    size                "WxH" (multiples of 8, at most max_pixels) or "auto" (model default)
    response_format     "b64_json" (default) | "url"
    output_format       "png" (default) | "jpeg" | "webp"
    output_compression  int 0..100: JPEG/WebP quality (ignored for PNG)
    user, safety_identifier   str, ignored
    stream              bool; partial_images int 0..3 (previews streamed before the result;
                        a 400 on a server whose engine streams no previews)
    stream_progress     bool: step progress as ``<prefix>.progress`` events (default: yes,
                        but not for an OpenAI SDK client, whose stream types would read them
                        as partial images: it gets them as SSE comments)
    timeout             seconds > 0: past it the request is aborted (HTTP 504); it is the
                        request's deadline_s, so the engine stops it within one step
    priority            int (lower runs first under --scheduling-policy priority; the
                        engine's min_priority..max_priority, default -10..10)
    num_inference_steps int 1..max_steps      } diffusion extensions
    guidance_scale      finite number >= 0    }
    negative_prompt     str                   }
    seed                int 0..2**32-1 (random when absent; echoed in the response)

Every image carries its recipe (unless the server runs with ``--no-metadata``): PNG as text
chunks, one per key of :func:`image_metadata` (``tEXt``, or ``iTXt`` for text beyond
Latin-1); JPEG and WebP only the ``parameters`` text, as the EXIF ``UserComment``.

GPT-image-only fields the model cannot honour (:data:`IGNORED_FIELDS`) are accepted, ignored,
and named in the ``X-Omni-Trio-Ignored-Fields`` response header.  Any other field is a 400
naming it.  Booleans are never accepted where a number is expected.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core.messages import RequestMetrics
from .._core.request import SamplingParams, canonical_lora
from ..errors import InvalidRequestError
from .api_spec import GENERATION_FIELDS, MAX_SEED, ServeLimits, bounds

__all__ = [
    "IGNORED_FIELDS",
    "IGNORED_FIELDS_HEADER",
    "MAX_SEED",
    "ApiError",
    "ImageStore",
    "ParsedRequest",
    "ServeLimits",
    "encode_b64",
    "encode_image",
    "error_body",
    "image_metadata",
    "image_size",
    "images_response",
    "parse_generation_request",
    "pil_save_options",
]

IGNORED_FIELDS = frozenset(f.name for f in GENERATION_FIELDS if f.ignored)
IGNORED_FIELDS_HEADER = "X-Omni-Trio-Ignored-Fields"
OUTPUT_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
RESPONSE_FORMATS = ("b64_json", "url")
DEFAULT_QUALITY = 95
# Recipe text: a prompt, negative prompt, model or scheduler name longer than this is cut
# (ending in an ellipsis) by image_metadata; any value longer than the second is cut by
# encode_image.  Both are characters.  The second keeps the EXIF UserComment (UTF-16, at most
# 4 bytes a character) inside JPEG's 64 KiB APP1 segment.
MAX_METADATA_FIELD_CHARS = 4096
MAX_METADATA_VALUE_CHARS = 16_000
_SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")
_KNOWN_FIELDS = frozenset(f.name for f in GENERATION_FIELDS if not f.ignored)


class ApiError(Exception):
    """An HTTP error answered with the OpenAI envelope (see :func:`error_body`).

    ``type`` is ``invalid_request_error`` for client errors and ``server_error`` for ours;
    ``param`` names the offending field; ``code`` is a short machine-readable reason;
    ``headers`` go on the response (``Retry-After``...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = tuple(headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, the OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated generation request: what the engine runs, and how to answer."""

    prompt: str
    params: SamplingParams
    model: str
    n: int = 1
    response_format: str = "b64_json"
    output_format: str = "png"
    output_compression: int | None = None
    stream: bool = False
    partial_images: int = 0
    # Progress as events (True), as SSE comments (False), or chosen by the client (None).
    stream_progress: bool | None = None
    timeout: float | None = None
    ignored_fields: tuple[str, ...] = field(default_factory=tuple)
    # Streaming events are named "<event_prefix>.partial_image", ".completed", ".progress".
    event_prefix: str = "image_generation"

    @property
    def content_type(self) -> str:
        return OUTPUT_FORMATS[self.output_format]


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__  # pragma: no cover - not a JSON value


def _int(body: Mapping[str, Any], name: str, low: int, high: int, default: int | None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer, got {_type_name(value)}", "invalid_type")
    if not low <= value <= high:
        raise _bad(name, f"{name} must be in {low}..{high}, got {value}")
    return value


def _str(body: Mapping[str, Any], name: str, max_chars: int | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(name, f"{name} must be a string, got {_type_name(value)}", "invalid_type")
    if max_chars is not None and len(value) > max_chars:
        raise _bad(name, f"{name} is {len(value)} characters long; at most {max_chars} allowed")
    return value


def _choice(body: Mapping[str, Any], name: str, choices: Sequence[str], default: str) -> str:
    value = _str(body, name)
    if value is None:
        return default
    if value not in choices:
        raise _bad(name, f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"{name} must be a number, got {_type_name(value)}", "invalid_type")
    if not math.isfinite(value):
        raise _bad(name, f"{name} must be a finite number")
    return float(value)


def _size(value: Any, limits: ServeLimits) -> tuple[int | None, int | None]:
    if value is None or value == "auto":
        return None, None
    if not isinstance(value, str):
        raise _bad("size", f"size must be a string 'WxH', got {_type_name(value)}", "invalid_type")
    match = _SIZE.fullmatch(value)
    if match is None:
        raise _bad("size", f"size must be 'WxH' (e.g. '512x512') or 'auto', got {value!r}")
    width, height = int(match[1]), int(match[2])
    if width < 8 or height < 8 or width % 8 or height % 8:
        raise _bad("size", f"width and height must be positive multiples of 8, got {value!r}")
    if width * height > limits.max_pixels:
        raise _bad(
            "size", f"size {value} is {width * height} pixels; at most {limits.max_pixels} allowed"
        )
    return width, height


def _lora(value: Any) -> tuple[tuple[str, float], ...]:
    """The ``lora`` field as ``((name, scale), ...)``; 400 (param ``lora``) for a malformed
    one (whether the names are registered is the engine's to say, at admission)."""
    if value is not None and not isinstance(value, str | list | dict):
        raise _bad(
            "lora",
            f'lora must be a name or a list of names and {{"name", "scale"}} objects, '
            f"got {_type_name(value)}",
            "invalid_type",
        )
    try:
        return canonical_lora(value)
    except InvalidRequestError as exc:
        raise _bad("lora", str(exc)) from None


def parse_generation_request(
    body: Any, *, limits: ServeLimits, default_model: str, adapters: Collection[str] = ()
) -> ParsedRequest:
    """Validate a decoded ``POST /v1/images/generations`` body (see the module docstring).

    ``default_model`` is the served model's name: ``model`` must be absent, null, or equal to
    it -- or name one of ``adapters`` (the LoRA adapters ``/v1/models`` lists as models of
    it), which then applies that adapter as ``"lora": name`` would.  Raises
    :class:`ApiError` (400 naming the field; 404 ``model_not_found`` for another model).
    The seed stays None when absent (the engine picks one at admission).
    """
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"the request body must be a JSON object, got {_type_name(body)}",
            code="invalid_type",
        )
    for name in body:
        if name not in _KNOWN_FIELDS and name not in IGNORED_FIELDS:
            raise _bad(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
    ignored = tuple(sorted(name for name in body if name in IGNORED_FIELDS))
    if body.get("partial_images") and not body.get("stream"):
        # Previews exist only in a stream: named as ignored rather than dropped in silence.
        ignored = tuple(sorted((*ignored, "partial_images")))

    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "prompt is required", "missing_required_parameter")
    prompt = _str(body, "prompt", limits.max_prompt_chars)
    if not prompt:
        raise _bad("prompt", "prompt must not be empty")

    model = _str(body, "model")
    implied_lora: str | None = None
    if model is not None and model != default_model and model in adapters:
        if body.get("lora") is not None:
            raise _bad("model", "name the LoRA adapter in model or in lora, not in both")
        implied_lora, model = model, default_model
    if model is not None and model != default_model:
        raise ApiError(
            404,
            f"The model {model!r} does not exist; this server serves {default_model!r}",
            param="model",
            code="model_not_found",
        )
    n = _int(body, "n", *bounds("n", limits), 1)
    width, height = _size(body.get("size"), limits)
    response_format = _choice(body, "response_format", RESPONSE_FORMATS, "b64_json")
    output_format = _choice(body, "output_format", tuple(OUTPUT_FORMATS), "png")
    compression = _int(body, "output_compression", *bounds("output_compression", limits), None)
    _str(body, "user")
    _str(body, "safety_identifier")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"stream must be a boolean, got {_type_name(stream)}", "invalid_type")
    partial_images = _int(body, "partial_images", *bounds("partial_images", limits), 0)
    stream_progress = body.get("stream_progress")
    if stream_progress is not None and not isinstance(stream_progress, bool):
        raise _bad(
            "stream_progress",
            f"stream_progress must be a boolean, got {_type_name(stream_progress)}",
            "invalid_type",
        )
    timeout = _number(body, "timeout")
    if timeout is not None and timeout <= 0:
        raise _bad("timeout", f"timeout must be > 0 seconds, got {timeout}")

    steps = _int(body, "num_inference_steps", *bounds("num_inference_steps", limits), None)
    guidance = _number(body, "guidance_scale")
    if guidance is not None and guidance < 0:
        raise _bad("guidance_scale", f"guidance_scale must be >= 0, got {guidance}")
    negative = _str(body, "negative_prompt", limits.max_prompt_chars)
    seed = _int(body, "seed", *bounds("seed", limits), None)
    # The range is the engine's (min_priority..max_priority), checked at admission.
    priority = _int(body, "priority", *bounds("priority", limits), None)
    lora = _lora(body.get("lora") if implied_lora is None else implied_lora)

    changes: dict[str, Any] = {
        "height": height,
        "width": width,
        "negative_prompt": negative,
        "seed": seed,
        "num_outputs_per_prompt": n,
    }
    if steps is not None:
        changes["num_inference_steps"] = steps
    if guidance is not None:
        changes["guidance_scale"] = guidance
    if priority is not None:
        changes["priority"] = priority
    if timeout is not None:
        changes["deadline_s"] = timeout
    if lora:
        changes["lora"] = lora
    return ParsedRequest(
        prompt=prompt,
        params=SamplingParams(**changes),
        model=default_model,
        n=n,
        response_format=response_format,
        output_format=output_format,
        output_compression=compression,
        stream=bool(stream),
        partial_images=partial_images,
        stream_progress=stream_progress,
        timeout=timeout,
        ignored_fields=ignored,
    )


# -- encoding -------------------------------------------------------------------------------


def _to_pil(image: Any) -> Any:
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    import numpy as np

    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise ValueError(f"cannot encode an array of shape {array.shape} as an image")
    if array.dtype != np.uint8:
        array = np.clip(np.rint(array.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    if array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(array)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\N{HORIZONTAL ELLIPSIS}"


def _decimal(value: float) -> str:
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _a1111_quote(text: str) -> str:
    """A value of the ``parameters`` settings line, quoted as AUTOMATIC1111 quotes it (JSON
    string syntax when it holds a comma, colon or newline, so the line still splits)."""
    if not any(c in text for c in ',:\n"'):
        return text
    return json.dumps(text, ensure_ascii=False)


def image_metadata(
    prompt: str,
    params: SamplingParams,
    *,
    model: str,
    scheduler: str | None,
    size: str | None = None,
    image_index: int | None = None,
) -> dict[str, str]:
    """The recipe of one image, as text: what :func:`encode_image` writes into it.

    Keys: ``prompt``; ``negative_prompt`` (when there is one); ``seed`` (when ``params.seed``
    is set: pass the seed the engine used, ``output.seed``); ``steps`` (``total_steps``);
    ``guidance_scale``; ``size`` ``"WxH"`` (``size``, else ``params`` when both sides are set,
    else left out); ``model``; ``scheduler`` (when known); ``n`` and ``image_index`` (when
    ``image_index`` is given); from a picture, ``steps`` is ``num_inference_steps`` and
    ``strength`` and ``conditioning`` (``image``, ``inpaint``) are added (A1111's
    ``Denoising strength``: the picture itself is not part of the recipe); with LoRA
    adapters, ``lora`` (``name:scale, ...``, and A1111's ``<lora:name:scale>`` after the
    prompt); and ``parameters``, all of it in the one-text form of
    AUTOMATIC1111's web UI (prompt, ``Negative prompt: ...``, then ``Steps: 20, Sampler: ...,
    CFG scale: 7.5, Seed: 5, Size: 64x64, Model: ...``), which other tools read.

    Seeds of several images: all ``n`` images of a request come from its one seed (image *k*
    is the *k*-th draw from the request's generator), so every image's ``seed`` is the
    request's and ``image_index`` says which draw it was: the same request (same seed and
    ``n``) gives the image again; the seed alone with ``n=1`` gives image 0 only.  In
    ``parameters`` that is ``Batch size: n, Batch pos: k`` (n > 1 only).

    Prompt, negative prompt, model and scheduler are cut at
    :data:`MAX_METADATA_FIELD_CHARS` characters and ``parameters`` at
    :data:`MAX_METADATA_VALUE_CHARS` (each ending in an ellipsis).  Pure.
    """

    def clip(text: str) -> str:
        return _clip(text, MAX_METADATA_FIELD_CHARS)

    if size is None and params.width is not None and params.height is not None:
        size = f"{params.width}x{params.height}"
    n = params.num_outputs_per_prompt
    meta: dict[str, str] = {"prompt": clip(prompt)}
    if params.negative_prompt:
        meta["negative_prompt"] = clip(params.negative_prompt)
    if params.seed is not None:
        meta["seed"] = str(params.seed)
    pictured = params.image is not None
    # From a picture the recipe is the schedule asked for and the strength that cut it.
    meta["steps"] = str(params.num_inference_steps if pictured else params.total_steps)
    if pictured:
        meta["strength"] = _decimal(params.effective_strength)
        meta["conditioning"] = params.conditioning
    meta["guidance_scale"] = _decimal(params.guidance_scale)
    lora = [(str(name), float(scale)) for name, scale in (params.lora or ())]
    if lora:
        meta["lora"] = clip(", ".join(f"{name}:{_decimal(scale)}" for name, scale in lora))
    if size is not None:
        meta["size"] = size
    meta["model"] = clip(model)
    if scheduler:
        meta["scheduler"] = clip(scheduler)
    if image_index is not None:
        meta["n"] = str(n)
        meta["image_index"] = str(image_index)

    settings = [("Steps", meta["steps"])]
    if "scheduler" in meta:
        settings.append(("Sampler", meta["scheduler"]))
    settings.append(("CFG scale", meta["guidance_scale"]))
    if "seed" in meta:
        settings.append(("Seed", meta["seed"]))
    if size is not None:
        settings.append(("Size", size))
    if pictured:
        settings.append(("Denoising strength", meta["strength"]))
    settings.append(("Model", meta["model"]))
    if image_index is not None and n > 1:
        settings += [("Batch size", str(n)), ("Batch pos", str(image_index))]
    # A1111 names the adapters in the prompt line: <lora:name:scale>.
    tags = "".join(f" <lora:{name}:{_decimal(scale)}>" for name, scale in lora)
    lines = [meta["prompt"] + tags]
    if "negative_prompt" in meta:
        lines.append(f"Negative prompt: {meta['negative_prompt']}")
    lines.append(", ".join(f"{name}: {_a1111_quote(value)}" for name, value in settings))
    meta["parameters"] = _clip("\n".join(lines), MAX_METADATA_VALUE_CHARS)
    return meta


# Latin-1 letters, digits, punctuation and spaces, 1..79 of them: a PNG text keyword.
_PNG_KEYWORD = re.compile(
    r"[\x21-\x7e\xa1-\xff](?:[\x20-\x7e\xa1-\xff]{0,77}[\x21-\x7e\xa1-\xff])?"
)
# C0 controls but tab and newline, DEL and the C1 controls: never written.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _clean_text(value: str) -> str:
    """``value`` made safe for any text chunk: controls (but tab and newline) dropped, lone
    surrogates (JSON can carry them) replaced, cut at :data:`MAX_METADATA_VALUE_CHARS`."""
    value = value.encode("utf-8", "replace").decode("utf-8")
    return _clip(_CONTROL.sub("", value), MAX_METADATA_VALUE_CHARS)


def _exif_user_comment(text: str) -> bytes:
    """A minimal EXIF block (big-endian TIFF) holding only ``UserComment``: ``UNICODE\\0`` and
    ``text`` in UTF-16BE, type UNDEFINED, as the EXIF spec and piexif write it."""
    comment = b"UNICODE\x00" + text.encode("utf-16-be")
    exif_ifd = 8 + 2 + 12 + 4  # after the header and IFD0 (one entry: the Exif IFD pointer)
    data = exif_ifd + 2 + 12 + 4  # after the Exif IFD (one entry: UserComment)
    return b"".join(
        [
            b"Exif\x00\x00MM\x00\x2a",
            struct.pack(">I", 8),
            struct.pack(">HHHII", 1, 0x8769, 4, 1, exif_ifd),  # ExifIFD pointer, LONG
            struct.pack(">I", 0),
            struct.pack(">HHHII", 1, 0x9286, 7, len(comment), data),  # UserComment, UNDEFINED
            struct.pack(">I", 0),
            comment,
        ]
    )


def pil_save_options(pil_format: str, metadata: Mapping[str, str] | None) -> dict[str, Any]:
    """The ``Image.save`` keywords that write ``metadata`` into a ``pil_format`` file
    (``"PNG"``, ``"JPEG"``, ``"WEBP"``; any other format: none, it carries no recipe).

    PNG: one text chunk per key (``tEXt``, ``iTXt`` when the text is not Latin-1); JPEG and
    WebP: ``metadata["parameters"]`` (else ``key: value`` lines) as the EXIF
    ``UserComment``.  Values are cleaned (controls but tab and newline dropped, lone
    surrogates replaced) and cut at :data:`MAX_METADATA_VALUE_CHARS`, so no text breaks the
    encoder.  Raises ``ValueError`` for a key that is not a PNG keyword (1..79 Latin-1
    characters, no leading or trailing space).
    """
    if not metadata:
        return {}
    for key in metadata:
        if not _PNG_KEYWORD.fullmatch(key):
            raise ValueError(f"{key!r} is not a PNG text keyword (1..79 Latin-1 characters)")
    fmt = pil_format.upper()
    if fmt == "PNG":
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for key, value in metadata.items():
            info.add_text(key, _clean_text(value))  # iTXt (UTF-8) when not Latin-1
        return {"pnginfo": info}
    if fmt in ("JPEG", "WEBP"):
        text = metadata.get("parameters")
        if text is None:
            text = "\n".join(f"{key}: {value}" for key, value in metadata.items())
        return {"exif": _exif_user_comment(_clean_text(text))}
    return {}


def encode_image(
    image: Any,
    output_format: str,
    compression: int | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Encode a PIL image (or an HWC array: uint8, or float in [0, 1]) as ``output_format``
    (``png`` lossless; ``jpeg``/``webp`` with quality ``compression``, default 95), with
    ``metadata`` (see :func:`image_metadata`) written in as :func:`pil_save_options` says:
    PNG text chunks, or JPEG/WebP EXIF ``UserComment`` (the ``parameters`` text only).

    Blocking CPU work: run it in a thread for large images.  Raises ``ValueError`` for an
    unknown format, an array that is not an image, or a metadata key that is not a PNG
    keyword; never for the text of a value.
    """
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"unknown output format {output_format!r}")
    pil = _to_pil(image)
    buffer = io.BytesIO()
    quality = DEFAULT_QUALITY if compression is None else compression
    pil_format = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[output_format]
    options = pil_save_options(pil_format, metadata)
    if output_format == "png":
        pil.save(buffer, format="PNG", **options)
    elif output_format == "jpeg":
        if pil.mode not in ("RGB", "L"):
            pil = pil.convert("RGB")
        pil.save(buffer, format="JPEG", quality=quality, **options)
    else:
        pil.save(buffer, format="WEBP", quality=quality, **options)
    return buffer.getvalue()


def encode_b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def image_size(image: Any) -> str:
    """``"WxH"`` of a PIL image or an HWC array."""
    size = getattr(image, "size", None)
    if isinstance(size, tuple) and len(size) == 2:
        return f"{size[0]}x{size[1]}"
    shape = getattr(image, "shape", None)
    if shape is not None and len(shape) >= 2:
        return f"{shape[1]}x{shape[0]}"
    return "auto"


def images_response(
    *,
    request_id: str,
    model: str,
    seed: int | None,
    data: Sequence[Mapping[str, Any]],
    output_format: str,
    size: str,
    metrics: RequestMetrics,
    total_ms: float,
    created: int | None = None,
) -> dict[str, Any]:
    """The 200 body of ``POST /v1/images/generations``: OpenAI's ``ImagesResponse``
    (``created``, ``data``, ``output_format``, ``size``) plus ``id``, ``seed``, ``model`` and
    ``metrics`` (engine queue wait and execution, and the server's total, in ms)."""
    return {
        "created": int(time.time()) if created is None else created,
        "data": [dict(item) for item in data],
        "id": request_id,
        "model": model,
        "seed": seed,
        "output_format": output_format,
        "size": size,
        "metrics": {
            "queue_wait_ms": round(metrics.queue_wait_ms, 3),
            "execution_ms": round(metrics.execution_ms, 3),
            "total_ms": round(total_ms, 3),
        },
    }


# -- the url store --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    data: bytes
    content_type: str
    expires_at: float


class ImageStore:
    """Encoded images kept in memory for ``response_format="url"``.

    Each :meth:`put` returns a fresh unguessable file id; the image can be read back with
    :meth:`get` until ``ttl_s`` seconds have passed (on ``clock``, injectable for tests) or
    until it is evicted, oldest first, to keep the total under ``max_bytes``.  Single-threaded
    (the app's trio thread); no I/O.
    """

    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_bytes: int = 256 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        # Insertion order is expiry order (one ttl for all): the oldest entry is first.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= len(entry.data)

    def _expire(self, now: float) -> None:
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._drop_oldest()

    def put(self, data: bytes, content_type: str) -> str:
        """Keep ``data``; return its file id.  ``ValueError`` if it alone exceeds
        ``max_bytes``."""
        if len(data) > self.max_bytes:
            raise ValueError(f"an image of {len(data)} bytes exceeds the store's max_bytes")
        now = self._clock()
        self._expire(now)
        while self._entries and self._bytes + len(data) > self.max_bytes:
            self._drop_oldest()
        file_id = f"file-{secrets.token_urlsafe(18)}"
        self._entries[file_id] = _Entry(bytes(data), content_type, now + self.ttl_s)
        self._bytes += len(data)
        return file_id

    def get(self, file_id: str) -> tuple[bytes, str] | None:
        """``(bytes, content_type)``, or None when unknown, expired or evicted."""
        self._expire(self._clock())
        entry = self._entries.get(file_id)
        if entry is None:
            return None
        return entry.data, entry.content_type

    @staticmethod
    def url_for(base_url: str, file_id: str) -> str:
        return f"{base_url.rstrip('/')}/v1/files/{file_id}/content"
