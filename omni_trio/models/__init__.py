"""The model layer: load a diffusers pipeline or a built-in and run fused batches on it.

Importing this package does not import torch or diffusers; :func:`load_model` does.
"""

from .base import DiffusionModel as DiffusionModel
from .base import ModelInfo as ModelInfo
from .base import StepHook as StepHook
from .builtin import BUILTIN_MODELS as BUILTIN_MODELS
from .echo import EchoInjectedError as EchoInjectedError
from .echo import decode_echo_image as decode_echo_image
from .loading import load_model as load_model
from .step import StepAdapter as StepAdapter
from .step import StepState as StepState

__all__ = [
    "BUILTIN_MODELS",
    "DiffusionModel",
    "EchoInjectedError",
    "ModelInfo",
    "StepAdapter",
    "StepHook",
    "StepState",
    "decode_echo_image",
    "load_model",
]
