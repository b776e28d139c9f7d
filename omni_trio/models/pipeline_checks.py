"""What a diffusers pipeline can be asked: explicit schedules and sizes, checked per request
(shared by request-mode forwards and the step adapters)."""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import InvalidRequestError
from .base import BatchParams, ModelInfo

__all__ = ["check_text2image_schedule", "check_unconditional_params"]


def check_text2image_schedule(
    info: ModelInfo, scheduler: Any, params: BatchParams, request_id: str
) -> None:
    """Raise :class:`InvalidRequestError` for explicit timesteps/sigmas ``scheduler`` does not
    take (naming the model, the scheduler class and ``request_id``)."""
    accepted = inspect.signature(scheduler.set_timesteps).parameters
    for param, values in (("timesteps", params.timesteps), ("sigmas", params.sigmas)):
        if values is not None and param not in accepted:
            raise InvalidRequestError(
                f"model {info.name}'s scheduler {type(scheduler).__name__} does "
                f"not take explicit {param} (request {request_id!r})",
                param=param,
            )


def check_unconditional_params(info: ModelInfo, params: BatchParams, request_id: str) -> None:
    """Raise :class:`InvalidRequestError` for what an unconditional model cannot do: explicit
    timesteps or sigmas, or a size other than its own."""
    if params.timesteps is not None or params.sigmas is not None:
        raise InvalidRequestError(
            f"model {info.name} does not take explicit timesteps or sigmas "
            f"(request {request_id!r})",
            param="timesteps" if params.timesteps is not None else "sigmas",
        )
    size = (info.default_height, info.default_width)
    if (params.height, params.width) != size:
        raise InvalidRequestError(
            f"model {info.name} only renders {size[1]}x{size[0]}, not "
            f"{params.width}x{params.height} (request {request_id!r})",
            param="size",
        )
