"""Requests and their sampling parameters (pure data, no I/O).

A :class:`DiffusionRequest` is immutable once admitted.  The engine fills in what admission
decides (a random seed when none was given) with :func:`dataclasses.replace`, so every
component that sees a request sees the same values.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..errors import InvalidRequestError

__all__ = [
    "CONDITIONINGS",
    "DEFAULT_IMAGE_STRENGTH",
    "DEFAULT_INPAINT_STRENGTH",
    "MAX_REQUEST_ID_LENGTH",
    "OUTPUT_TYPES",
    "MAX_LORA_SCALE",
    "Conditioning",
    "DiffusionRequest",
    "LoraSpec",
    "OutputType",
    "RequestLimits",
    "SamplingParams",
    "canonical_lora",
    "image_size",
    "text_problem",
    "validate_request",
]

OutputType = Literal["pil", "np", "pt", "latent"]
OUTPUT_TYPES: tuple[str, ...] = get_args(OutputType)
# What a request starts from: noise (text-to-image), a picture (image-to-image), or a picture
# with a mask of the region to repaint (inpainting).
Conditioning = Literal["text", "image", "inpaint"]
CONDITIONINGS: tuple[str, ...] = get_args(Conditioning)
# diffusers' defaults (StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline).
DEFAULT_IMAGE_STRENGTH = 0.8
DEFAULT_INPAINT_STRENGTH = 1.0
MAX_REQUEST_ID_LENGTH = 256
MAX_SEED = 2**63 - 1
# The LoRA adapters of a request: (registered name, scale) pairs, sorted by name.
LoraSpec = tuple[tuple[str, float], ...]
MAX_LORA_SCALE = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request.

    ``height``/``width`` of ``None`` mean the model's default size.  ``seed`` of ``None`` means
    a random seed chosen at admission and reported on the output.  ``timesteps``/``sigmas``,
    when given, fix the schedule (and the step count, in that order of precedence).
    ``extra_args`` is model-specific and passed through untouched.  ``priority`` orders the
    queue under ``scheduling_policy="priority"`` (lower runs first; ignored by the other
    policies); ``deadline_s`` (seconds from admission) ends the request ``FINISHED_ABORTED``
    with :class:`~omni_trio.errors.RequestTimeoutError` if it has not finished by then.
    Neither is part of a compatibility key.

    ``lora`` names the LoRA adapters to apply, registered with ``EngineConfig.loras``: a
    name (scale 1.0), a ``(name, scale)`` pair, or a sequence of either.  The engine makes
    it a tuple of ``(name, scale)`` sorted by name at admission (:func:`canonical_lora`);
    it is part of both compatibility keys, so requests with other adapters or scales never
    share a forward.

    ``image`` (a PIL image, or an ``(H, W)``/``(H, W, C)`` uint8 array with C of 1, 3 or 4)
    makes the request image-to-image; with ``mask_image`` too (same size; white, or 255, marks
    what to repaint) it is inpainting.  The picture is resized to the request's size, which
    defaults to the picture's own (rounded down to a multiple of 8; one side given, the other
    follows the picture's aspect ratio).  The engine makes it a loaded RGB image (the mask L)
    at admission (:mod:`omni_trio.runtime.pictures`).  ``strength`` (in
    ``(0, 1]``, default 0.8 for image-to-image and 1.0 for inpainting, as in diffusers) is how
    much noise is added to it: the request runs ``int(num_inference_steps * strength)`` of
    its steps.  Images are compared by identity (``==`` on two params ignores them).
    """

    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 20
    guidance_scale: float = 7.5
    negative_prompt: str | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    output_type: OutputType = "pil"
    timesteps: tuple[float, ...] | None = None
    sigmas: tuple[float, ...] | None = None
    extra_args: Mapping[str, Any] = field(default_factory=dict)
    priority: int = 0
    deadline_s: float | None = None
    image: Any = field(default=None, compare=False)
    mask_image: Any = field(default=None, compare=False)
    strength: float | None = None
    lora: Any = ()

    @property
    def conditioning(self) -> Conditioning:
        """``"text"`` without an image, ``"image"`` with one, ``"inpaint"`` with a mask too."""
        if self.image is None:
            return "text"
        return "image" if self.mask_image is None else "inpaint"

    @property
    def effective_strength(self) -> float:
        """``strength``, or its default for the conditioning (1.0 for text-to-image)."""
        if self.strength is not None:
            return float(self.strength)
        if self.image is None:
            return 1.0
        return DEFAULT_IMAGE_STRENGTH if self.mask_image is None else DEFAULT_INPAINT_STRENGTH

    @property
    def total_steps(self) -> int:
        """Denoising steps this request runs: timesteps > sigmas > num_inference_steps; from
        a picture, the last ``int(num_inference_steps * strength)`` of them (diffusers'
        ``get_timesteps``)."""
        if self.timesteps is not None:
            return len(self.timesteps)
        if self.sigmas is not None:
            return len(self.sigmas)
        if self.image is not None:
            steps = self.num_inference_steps
            return min(int(steps * self.effective_strength), steps)
        return self.num_inference_steps

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class DiffusionRequest:
    """One prompt to render.  Every message about it carries ``request_id``.

    ``condition_key`` is set by model preprocessing when a model needs extra conditions to match
    before two requests may share a batch; it is part of the compatibility key.
    """

    prompt: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    condition_key: Hashable | None = None

    def replace(self, **changes: Any) -> DiffusionRequest:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Hard limits applied by :func:`validate_request` (from ``EngineConfig``)."""

    max_pixels: int = 4096 * 4096
    # A picture to start from (image-to-image, inpainting), before it is resized to the
    # request's size (which max_pixels bounds).
    max_image_pixels: int = 4096 * 4096
    max_prompt_chars: int = 10_000
    max_steps: int = 1000
    max_outputs: int = 16
    min_priority: int = -10
    max_priority: int = 10


def image_size(image: Any) -> tuple[int, int] | None:
    """``(width, height)`` of a PIL image or an ``(H, W)``/``(H, W, C)`` array (C in 1, 3,
    4) of uint8, read without importing either library; None for anything else."""
    size = getattr(image, "size", None)
    mode = getattr(image, "mode", None)
    if isinstance(mode, str) and isinstance(size, tuple) and len(size) == 2:
        width, height = size
        if isinstance(width, int) and isinstance(height, int):
            return width, height
        return None
    shape = getattr(image, "shape", None)
    dtype = getattr(image, "dtype", None)
    if not isinstance(shape, tuple) or str(dtype) != "uint8":
        return None
    if len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3, 4)):
        return int(shape[1]), int(shape[0])
    return None


def _check_images(sp: SamplingParams, limits: RequestLimits) -> None:
    """The picture, the mask and the strength of an image-conditioned request."""
    if sp.image is None:
        if sp.mask_image is not None:
            raise _fail("mask_image needs an image to repaint", "mask_image")
        if sp.strength is not None:
            raise _fail("strength applies only to a request with an image", "strength")
        return
    size = image_size(sp.image)
    if size is None:
        raise _fail(
            "image must be a PIL image or an (H, W) / (H, W, C) uint8 array with C in 1, 3, 4, "
            f"not {type(sp.image).__name__}",
            "image",
        )
    width, height = size
    if width < 8 or height < 8:
        raise _fail(f"image is {width}x{height}; both sides must be at least 8", "image")
    if width * height > limits.max_image_pixels:
        raise _fail(
            f"image is {width}x{height} ({width * height} pixels); "
            f"at most {limits.max_image_pixels} allowed",
            "image",
        )
    if sp.mask_image is not None:
        mask_size = image_size(sp.mask_image)
        if mask_size is None:
            raise _fail(
                "mask_image must be a PIL image or an (H, W) / (H, W, C) uint8 array, "
                f"not {type(sp.mask_image).__name__}",
                "mask_image",
            )
        if mask_size != size:
            raise _fail(
                f"mask_image is {mask_size[0]}x{mask_size[1]} but image is {width}x{height}; "
                "they must match",
                "mask_image",
            )
    st = sp.strength
    if st is not None and (
        isinstance(st, bool)
        or not isinstance(st, int | float)
        or not math.isfinite(st)
        or not 0 < st <= 1
    ):
        raise _fail(f"strength must be a number in (0, 1], got {st!r}", "strength")
    if sp.timesteps is not None or sp.sigmas is not None:
        name = "timesteps" if sp.timesteps is not None else "sigmas"
        raise _fail(f"{name} cannot be combined with an image (use num_inference_steps)", name)
    if sp.total_steps < 1:
        raise _fail(
            f"strength {sp.effective_strength} of {sp.num_inference_steps} steps runs no step "
            "at all: raise strength or num_inference_steps",
            "strength",
        )


def _fail(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


# Control characters a prompt may hold (whitespace); every other one is rejected.
_ALLOWED_CONTROLS = frozenset("\t\n\r")
# How deep extra_args may nest (its strings are checked all the way down).
_MAX_EXTRA_DEPTH = 32


def text_problem(text: str, *, controls: bool = True) -> str | None:
    """What makes ``text`` unfit to carry (None if nothing): a lone surrogate, which no UTF-8
    encoder can write, or (``controls``) a control character other than tab, newline and
    carriage return.  Names the first offender and its index."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start}"
    if controls and not text.isprintable():
        for index, char in enumerate(text):
            if char not in _ALLOWED_CONTROLS and unicodedata.category(char) == "Cc":
                return f"holds the control character U+{ord(char):04X} at index {index}"
    return None


def _check_text(text: str, param: str, *, controls: bool = True) -> None:
    problem = text_problem(text, controls=controls)
    if problem is not None:
        raise _fail(f"{param} {problem}", param)


def _check_extra(value: Any, depth: int = 0) -> None:
    """Every string in ``extra_args`` (keys too) is encodable; its nesting is bounded."""
    if depth > _MAX_EXTRA_DEPTH:
        raise _fail(f"extra_args nests deeper than {_MAX_EXTRA_DEPTH} levels", "extra_args")
    if isinstance(value, str):
        _check_text(value, "extra_args", controls=False)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_extra(key, depth + 1)
            _check_extra(item, depth + 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _check_extra(item, depth + 1)


def canonical_lora(value: Any) -> LoraSpec:
    """``SamplingParams.lora`` as ``((name, scale), ...)`` sorted by name: from ``None`` or
    ``()`` (no adapter), a name, a ``(name, scale)`` pair, a ``{"name", "scale"}`` mapping, or
    a sequence of them.  Raises :class:`InvalidRequestError` (``param="lora"``) for anything
    else, an empty or non-printable name, a scale that is not a finite number within
    +-:data:`MAX_LORA_SCALE`, or a name given twice."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str | Mapping) else value
    if (
        isinstance(items, tuple | list)
        and len(items) == 2
        and isinstance(items[0], str)
        and isinstance(items[1], int | float)  # one (name, scale) pair, not two names
        and not isinstance(items[1], bool)
    ):
        items = [items]
    if not isinstance(items, list | tuple):
        raise _fail(
            f"lora must be a name, a (name, scale) pair or a list of them, not "
            f"{type(value).__name__}",
            "lora",
        )
    spec: dict[str, float] = {}
    for item in items:
        if isinstance(item, str):
            name, scale = item, 1.0
        elif isinstance(item, Mapping):
            unknown = sorted(str(k) for k in item if k not in ("name", "scale"))
            if unknown or "name" not in item:
                raise _fail('a lora entry must be {"name": str, "scale": number}', "lora")
            name, scale = item["name"], item.get("scale", 1.0)
        elif isinstance(item, list | tuple) and len(item) == 2:
            name, scale = item
        else:
            raise _fail(
                f"a lora entry must be a name or a (name, scale) pair, got {item!r}", "lora"
            )
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 128:
            raise _fail(f"a LoRA name must be a non-empty printable string, got {name!r}", "lora")
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not math.isfinite(scale)
            or abs(scale) > MAX_LORA_SCALE
        ):
            raise _fail(
                f"the scale of LoRA {name!r} must be a finite number in "
                f"-{MAX_LORA_SCALE:g}..{MAX_LORA_SCALE:g}, got {scale!r}",
                "lora",
            )
        if name in spec:
            raise _fail(f"LoRA {name!r} is given twice", "lora")
        spec[name] = float(scale)
    return tuple(sorted(spec.items()))


def validate_request(request: DiffusionRequest, limits: RequestLimits | None = None) -> None:
    """Raise :class:`InvalidRequestError` (naming the field) if ``request`` must not be admitted.

    Pure and synchronous; nothing is admitted when it raises.
    """
    limits = limits or RequestLimits()
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise _fail("request_id must be a non-empty string", "request_id")
    if len(rid) > MAX_REQUEST_ID_LENGTH:
        raise _fail(
            f"request_id is {len(rid)} characters long; at most {MAX_REQUEST_ID_LENGTH} allowed",
            "request_id",
        )
    if not rid.isprintable():
        raise _fail("request_id must contain printable characters only", "request_id")
    if not isinstance(request.prompt, str):
        raise _fail(f"prompt must be a string, not {type(request.prompt).__name__}", "prompt")
    if len(request.prompt) > limits.max_prompt_chars:
        raise _fail(
            f"prompt is {len(request.prompt)} characters; at most {limits.max_prompt_chars}",
            "prompt",
        )
    _check_text(request.prompt, "prompt")
    sp = request.sampling
    if not isinstance(sp, SamplingParams):
        raise _fail(f"sampling must be SamplingParams, not {type(sp).__name__}", "sampling")
    for name in ("height", "width"):
        value = getattr(sp, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _fail(f"{name} must be a positive integer, got {value!r}", name)
        if value % 8:
            raise _fail(f"{name} must be a multiple of 8, got {value}", name)
    if sp.height is not None and sp.width is not None and sp.height * sp.width > limits.max_pixels:
        raise _fail(
            f"{sp.width}x{sp.height} is {sp.height * sp.width} pixels; "
            f"at most {limits.max_pixels} allowed",
            "size",
        )
    steps = sp.num_inference_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= limits.max_steps:
        raise _fail(
            f"num_inference_steps must be an integer in 1..{limits.max_steps}, got {steps!r}",
            "num_inference_steps",
        )
    for name in ("timesteps", "sigmas"):
        seq = getattr(sp, name)
        if seq is None:
            continue
        # A tuple, so compatibility keys (which include the schedule) stay hashable.
        if not isinstance(seq, tuple):
            raise _fail(f"{name} must be a tuple of numbers, not {type(seq).__name__}", name)
        if not 1 <= len(seq) <= limits.max_steps:
            raise _fail(f"{name} must hold 1..{limits.max_steps} values", name)
        if not all(
            not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) for v in seq
        ):
            raise _fail(f"{name} must hold finite numbers only", name)
    gs = sp.guidance_scale
    if isinstance(gs, bool) or not isinstance(gs, int | float) or not math.isfinite(gs) or gs < 0:
        raise _fail(f"guidance_scale must be a finite number >= 0, got {gs!r}", "guidance_scale")
    if sp.negative_prompt is not None:
        if not isinstance(sp.negative_prompt, str):
            raise _fail("negative_prompt must be a string or None", "negative_prompt")
        if len(sp.negative_prompt) > limits.max_prompt_chars:
            raise _fail(
                f"negative_prompt is {len(sp.negative_prompt)} characters; "
                f"at most {limits.max_prompt_chars}",
                "negative_prompt",
            )
        _check_text(sp.negative_prompt, "negative_prompt")
    n = sp.num_outputs_per_prompt
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_outputs:
        raise _fail(
            f"num_outputs_per_prompt must be an integer in 1..{limits.max_outputs}, got {n!r}",
            "num_outputs_per_prompt",
        )
    if sp.output_type not in OUTPUT_TYPES:
        raise _fail(
            f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {sp.output_type!r}",
            "output_type",
        )
    if sp.seed is not None and (
        isinstance(sp.seed, bool) or not isinstance(sp.seed, int) or not 0 <= sp.seed <= MAX_SEED
    ):
        raise _fail(f"seed must be an integer in 0..2**63-1, got {sp.seed!r}", "seed")
    pr = sp.priority
    if isinstance(pr, bool) or not isinstance(pr, int):
        raise _fail(f"priority must be an integer, got {pr!r}", "priority")
    if not limits.min_priority <= pr <= limits.max_priority:
        raise _fail(
            f"priority must be in {limits.min_priority}..{limits.max_priority}, got {pr}",
            "priority",
        )
    dl = sp.deadline_s
    if dl is not None and (
        isinstance(dl, bool) or not isinstance(dl, int | float) or not math.isfinite(dl) or dl <= 0
    ):
        raise _fail(f"deadline_s must be a finite number of seconds > 0, got {dl!r}", "deadline_s")
    if not isinstance(sp.extra_args, Mapping):
        raise _fail("extra_args must be a mapping", "extra_args")
    _check_extra(sp.extra_args)
    _check_images(sp, limits)
    canonical_lora(sp.lora)
