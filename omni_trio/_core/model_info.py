"""What the runtime may rely on about a loaded model (pure data, shared by every layer).

The engine never looks at a model's family: what admission needs (the default size, whether
other sizes are allowed, what a warmup request looks like) is answered here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..errors import InvalidRequestError
from .faults import FAULTS_KEY
from .request import SamplingParams

__all__ = ["FAMILIES", "Family", "ModelInfo"]

Family = Literal["text2image", "unconditional", "echo"]
FAMILIES: tuple[str, ...] = ("text2image", "unconditional", "echo")
_GUIDANCE = SamplingParams().guidance_scale
_SET_FIELDS = ("extra_args", "ignored_params")
# Warmup renders at most this size (it only has to touch every code path once).
_WARMUP_MAX_SIDE = 64


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the runner may rely on about a loaded model.

    ``name`` is the built-in name (``builtin:tiny-sd``) or the local path as given.
    ``supports_batch``: several requests may share one ``DiffusionModel.generate`` call.
    ``default_height``/``default_width`` are used when a request leaves its size ``None``.
    ``text_conditioned``: the output depends on the prompt (and negative prompt).
    ``supports_steps``: ``DiffusionModel.step_adapter`` returns an adapter (step mode).
    ``fixed_size``: the model renders only its default size; left None it is what the
    family implies (an unconditional UNet renders the one size it was trained at).
    ``min_side``: the smallest height and width it renders (a UNet's GroupNorms need more
    than one value per group at its deepest level); smaller sizes are refused at admission.
    ``max_side``: the largest it renders well (None: no bound of its own); larger sizes are
    refused at admission.
    ``extra_args``: the ``SamplingParams.extra_args`` keys it reads; any other key (beside
    the runtime's own ``faults``) is refused at admission.  None: the model checks them.
    ``ignored_params``: sampling fields it accepts but does not use (an unconditional model
    ignores ``prompt``, ``negative_prompt`` and ``guidance_scale``); the engine warns once.
    ``calibrate``: its step time is measured at warmup for the compute budget (see
    ``omni_trio._core.cost``); the diffusers models say True, fakes and echo (whose time is
    what its options say) leave it False.
    ``scheduler``: the name of the noise scheduler it samples with (a diffusers pipeline's
    scheduler class, ``"DDIMScheduler"``), written into each image's recipe; None where the
    model has none to name.
    ``image_input``: it takes a picture to start from (``SamplingParams.image``, image-to-image)
    and a mask of what to repaint (``mask_image``, inpainting); without it such requests are
    refused at admission.
    ``lora_input``: it applies LoRA adapters (``SamplingParams.lora``); without it a request
    naming one is refused at admission.
    """

    name: str
    family: Family
    supports_batch: bool
    default_height: int
    default_width: int
    text_conditioned: bool
    supports_steps: bool = False
    fixed_size: bool | None = None
    # The smallest height and width it renders (pixels; smaller sizes are refused).
    min_side: int = 8
    max_side: int | None = None
    extra_args: frozenset[str] | None = None
    ignored_params: frozenset[str] = frozenset()
    calibrate: bool = False
    scheduler: str | None = None
    image_input: bool = False
    lora_input: bool = False

    def __post_init__(self) -> None:
        if self.fixed_size is None:
            object.__setattr__(self, "fixed_size", self.family == "unconditional")

    def resolve_size(self, height: int | None, width: int | None) -> tuple[int, int]:
        """The size a request renders at: its own, or the default for what it left unset.

        Raises :class:`InvalidRequestError` (``param="size"``) for a size a fixed-size model
        cannot render.
        """
        h = self.default_height if height is None else height
        w = self.default_width if width is None else width
        if self.fixed_size and (h, w) != (self.default_height, self.default_width):
            raise InvalidRequestError(
                f"model {self.name} only renders {self.default_width}x{self.default_height}, "
                f"not {w}x{h}",
                param="size",
            )
        if min(h, w) < self.min_side:
            raise InvalidRequestError(
                f"model {self.name} renders sizes from {self.min_side}x{self.min_side} up, "
                f"not {w}x{h}",
                param="size",
            )
        if self.max_side is not None and max(h, w) > self.max_side:
            raise InvalidRequestError(
                f"model {self.name} renders sizes up to {self.max_side}x{self.max_side}, "
                f"not {w}x{h}",
                param="size",
            )
        return h, w

    def check_conditioning(self, sampling: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` (``param="image"``) for a picture given to a
        model that cannot start from one."""
        if sampling.image is not None and not self.image_input:
            raise InvalidRequestError(
                f"model {self.name} does not take an image to start from (image-to-image and "
                "inpainting need a text-to-image diffusers pipeline with step support)",
                param="image",
            )

    def check_lora(self, lora: Any, registered: Collection[str]) -> None:
        """Raise :class:`InvalidRequestError` (``param="lora"``) for adapters this model
        cannot apply, or names not among ``registered`` (``EngineConfig.loras``)."""
        if not lora:
            return
        if not self.lora_input:
            raise InvalidRequestError(
                f"model {self.name} cannot apply LoRA adapters (a text-to-image diffusers "
                "pipeline can)",
                param="lora",
            )
        unknown = [name for name, _ in lora if name not in registered]
        if unknown:
            known = ", ".join(sorted(registered)) if registered else "none"
            raise InvalidRequestError(
                f"unknown LoRA adapter {unknown[0]!r} (registered: {known})", param="lora"
            )

    def check_extra_args(self, extra_args: Mapping[str, Any]) -> None:
        """Raise :class:`InvalidRequestError` (``param="extra_args"``) for a key this model
        does not read (``faults`` is the runtime's, checked apart)."""
        if self.extra_args is None:
            return
        unknown = sorted(str(k) for k in extra_args if k not in self.extra_args and k != FAULTS_KEY)
        if unknown:
            reads = ", ".join(sorted(self.extra_args)) if self.extra_args else "none"
            raise InvalidRequestError(
                f"model {self.name} does not read extra_args {', '.join(map(repr, unknown))} "
                f"(it reads: {reads})",
                param="extra_args",
            )

    def ignored(self, sampling: SamplingParams) -> tuple[str, ...]:
        """The fields of ``sampling`` this model will not use although they are set."""
        if not self.ignored_params:
            return ()
        names = []
        if "prompt" in self.ignored_params:
            names.append("prompt")
        if "negative_prompt" in self.ignored_params and sampling.negative_prompt:
            names.append("negative_prompt")
        if "guidance_scale" in self.ignored_params and sampling.guidance_scale != _GUIDANCE:
            names.append("guidance_scale")
        return tuple(names)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (sets as sorted lists), for the wire; see :meth:`from_dict`."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in data.items():
            if isinstance(value, frozenset):
                data[key] = sorted(value)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelInfo:
        """The inverse of :meth:`to_dict`."""
        data = dict(data)
        for key in _SET_FIELDS:
            if data.get(key) is not None:
                data[key] = frozenset(data[key])
        return cls(**data)

    def warmup_sampling(self) -> SamplingParams:
        """A small request (2 steps, seed 0) that runs every code path of this model once."""
        if self.fixed_size:
            size: int | None = None
        else:
            size = min(_WARMUP_MAX_SIDE, self.default_height, self.default_width)
            size = max(size, self.min_side)
        return SamplingParams(height=size, width=size, num_inference_steps=2, seed=0)
