"""The worker's two extension points: the runner class it builds and a worker extension.

``EngineConfig.runner_cls`` (a :class:`~omni_trio.worker.runner.ModelRunner` subclass or the
import path of one; None: ``ModelRunner``) is the class :meth:`Worker.load_model
<omni_trio.worker.worker.Worker.load_model>` builds, with ``ModelRunner``'s arguments.

``EngineConfig.worker_extension_cls`` names a class whose public methods (names not starting
with ``_``) become worker RPCs: ``engine.collective_rpc(name, ...)`` reaches them on every
backend, rank-aware and with errors boxed like the built-in calls.  Each worker builds one
instance once its model is loaded, as ``cls(worker)`` (composition, not a mix-in: the
extension sees the worker and its runner but cannot shadow the worker's own attributes), and
drops it at shutdown.  A public name that is also a built-in RPC (:data:`RPC_METHODS
<omni_trio.worker.worker.RPC_METHODS>`) is refused before the model loads, since the
built-in would silently win.

Both are resolved in the worker's own process, so an import path is imported there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ..errors import InvalidConfigError
from ..import_path import resolve_class, resolve_import_path
from .runner import ModelRunner

__all__ = ["WorkerExtension", "extension_class", "public_methods", "runner_class"]


def runner_class(value: Any) -> type[ModelRunner]:
    """``EngineConfig.runner_cls`` as a class: ``ModelRunner`` for None, else the class (or
    the import path's) if it is a ``ModelRunner`` subclass; :class:`InvalidConfigError`
    (``runner_cls``) otherwise."""
    if value is None:
        return ModelRunner
    return resolve_class(
        value,
        field="runner_cls",
        base=ModelRunner,
        what="a subclass of omni_trio.worker.runner.ModelRunner",
    )


def public_methods(cls: type) -> frozenset[str]:
    """The names of ``cls``'s callable attributes that do not start with ``_`` (its own and
    inherited; properties and plain values are not methods)."""
    return frozenset(
        name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))
    )


def extension_class(value: Any, *, reserved: Collection[str]) -> type | None:
    """``EngineConfig.worker_extension_cls`` as a class (None for None).

    Raises :class:`InvalidConfigError` (``worker_extension_cls``) for an import path that
    does not resolve, something that is not a class, or a class with a public method named
    like one in ``reserved`` (the built-in RPCs).
    """
    if value is None:
        return None
    field = "worker_extension_cls"
    cls = resolve_import_path(value, field=field, what="class") if isinstance(value, str) else value
    if not isinstance(cls, type):
        raise InvalidConfigError(f"{field} must be a class, {value!r} is {cls!r}", field=field)
    clash = sorted(public_methods(cls) & set(reserved))
    if clash:
        raise InvalidConfigError(
            f"worker_extension_cls {cls.__module__}.{cls.__qualname__} may not override the "
            f"worker's built-in RPC method(s) {', '.join(clash)}: rename them",
            field=field,
        )
    return cls


class WorkerExtension:
    """One worker's extension instance and the methods it serves."""

    def __init__(self, cls: type, worker: Any) -> None:
        self.instance = cls(worker)
        self.methods = public_methods(cls)

    def method(self, name: str) -> Callable[..., Any] | None:
        """The bound method ``name`` serves, or None if it is not one of its public methods."""
        if name not in self.methods:
            return None
        bound: Callable[..., Any] = getattr(self.instance, name)
        return bound
