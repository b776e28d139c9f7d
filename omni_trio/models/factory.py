"""Models from outside: ``EngineConfig(model="package.module:factory")``.

A *model factory* is a callable, named by its import path, that each worker calls once to
build its model::

    def factory(*, device: torch.device, dtype: torch.dtype,
                options: Mapping[str, Any]) -> DiffusionModel

``device`` and ``dtype`` are the worker's (resolved from ``EngineConfig.device`` and
``dtype``), ``options`` is ``EngineConfig.model_options`` (without the worker's ``fault_*``
options).  The factory refuses options it does not know with
:class:`~omni_trio.errors.InvalidConfigError` (``field="model_options"``), as the built-ins
do.  It runs in the worker's thread (inproc) or process (tractor, ray), so its module must be
importable there.

A ``model`` string is a factory path when it has that shape (dotted names on both sides of one
``:``), is not a built-in (``builtin:...``) and is not an existing local directory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError
from ..import_path import is_import_path, resolve_import_path
from .base import DiffusionModel
from .builtin import BUILTIN_PREFIX

if TYPE_CHECKING:
    import torch

__all__ = ["FACTORY_KEYWORDS", "is_factory_model", "load_factory_model", "resolve_factory"]

# The keyword arguments every factory is called with.
FACTORY_KEYWORDS = ("device", "dtype", "options")


def is_factory_model(model: str) -> bool:
    """Whether ``model`` names a model factory (``"package.module:factory"``); a built-in
    name or an existing directory never does.  Imports nothing."""
    return (
        is_import_path(model)
        and not model.startswith(BUILTIN_PREFIX)
        and not Path(model).expanduser().is_dir()
    )


def resolve_factory(model: str) -> Callable[..., Any]:
    """The callable ``model`` names, imported; :class:`InvalidConfigError` (``field="model"``)
    for a path that does not resolve, something not callable, or a callable that does not
    take the keyword arguments ``device``, ``dtype`` and ``options``."""
    factory = resolve_import_path(model, field="model", what="model factory")
    if not callable(factory):
        raise InvalidConfigError(
            f"model {model!r} names {type(factory).__name__} {factory!r}, not a callable "
            "model factory",
            field="model",
        )
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (some builtins): call and see
        return factory
    try:
        signature.bind(**dict.fromkeys(FACTORY_KEYWORDS))
    except TypeError as exc:
        raise InvalidConfigError(
            f"model factory {model!r} must accept the keyword arguments "
            f"{', '.join(FACTORY_KEYWORDS)} ({exc})",
            field="model",
        ) from None
    return factory


def load_factory_model(
    model: str, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]
) -> DiffusionModel:
    """Call the factory ``model`` names (blocking, as long as it takes).  Raises
    :class:`InvalidConfigError` (``field="model"``) as :func:`resolve_factory` does, or if
    it returns anything but a :class:`DiffusionModel` (whatever it returned that has a
    ``close`` is closed first); what the factory itself raises propagates."""
    factory = resolve_factory(model)
    built = factory(device=device, dtype=dtype, options=options)
    if not isinstance(built, DiffusionModel):
        close = getattr(built, "close", None)
        if callable(close):
            close()
        raise InvalidConfigError(
            f"model factory {model!r} returned {type(built).__name__}, not an "
            "omni_trio.models.DiffusionModel",
            field="model",
        )
    return built
