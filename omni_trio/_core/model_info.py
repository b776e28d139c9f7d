"""What the runtime may rely on about a loaded model (pure data, shared by every layer).

The engine never looks at a model's family: what admission needs (the default size, whether
other sizes are allowed, what a warmup request looks like) is answered here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidRequestError
from .request import SamplingParams

__all__ = ["FAMILIES", "Family", "ModelInfo"]

Family = Literal["text2image", "unconditional", "echo"]
FAMILIES: tuple[str, ...] = ("text2image", "unconditional", "echo")
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
        return h, w

    def warmup_sampling(self) -> SamplingParams:
        """A small request (2 steps, seed 0) that runs every code path of this model once."""
        if self.fixed_size:
            size: int | None = None
        else:
            size = min(_WARMUP_MAX_SIDE, self.default_height, self.default_width)
        return SamplingParams(height=size, width=size, num_inference_steps=2, seed=0)
