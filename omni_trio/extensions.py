"""The extension points of :class:`~omni_trio.config.EngineConfig`, checked when a config is
made; see docs/extending.md for what each hook may do.

=========================  ==============================================================
``scheduler_cls``          a subclass of the mode's scheduler: :class:`RequestScheduler`
                           (request mode) or :class:`StepScheduler` (``step_execution``);
                           resolved here, used by the engine core in this process
``runner_cls``             a :class:`~omni_trio.worker.runner.ModelRunner` subclass; each
                           worker builds it at ``load_model``
``worker_extension_cls``   a class whose public methods each worker serves through
                           ``collective_rpc`` (:mod:`omni_trio.worker.extension`)
=========================  ==============================================================

Each takes a class or an import path ``"package.module:Name"`` (None: the built-in).  The
scheduler is resolved and checked here, at once.  The worker-side classes are resolved where
they run (a Ray worker may be another machine), so here only their shape is checked, and for
the process backends (``tractor``, ``ray``) that a class given as an object can travel: a
configuration crosses to worker processes as plain data, so such a class goes as its import
path (:func:`wire_extensions`), and a class no other process can import by that path (a
script's ``__main__``, a class made inside a function) is refused
(:func:`~omni_trio.import_path.portable_path`).

The scheduler bases are re-exported here so that a subclass needs no private import.
"""

from __future__ import annotations

from typing import Any

from ._core.scheduler import RequestScheduler as RequestScheduler
from ._core.scheduler import Scheduler as Scheduler
from ._core.scheduler import StepScheduler as StepScheduler
from .errors import InvalidConfigError
from .import_path import is_import_path, portable_path, resolve_class

__all__ = [
    "PROCESS_BACKENDS",
    "WORKER_EXTENSION_FIELDS",
    "RequestScheduler",
    "Scheduler",
    "StepScheduler",
    "check_extensions",
    "scheduler_class",
    "wire_extensions",
]

# The built-in backends whose workers are other processes: their config travels as data.
PROCESS_BACKENDS = ("tractor", "ray")
# The fields each worker resolves for itself (the scheduler stays in the engine's process).
WORKER_EXTENSION_FIELDS = ("runner_cls", "worker_extension_cls")


def _mode(step_execution: bool) -> str:
    return "step mode (step_execution=True)" if step_execution else "request mode"


def scheduler_class(value: Any, *, step_execution: bool) -> type[Scheduler] | None:
    """``EngineConfig.scheduler_cls`` as a class (None stays None: the mode's default).

    It must subclass the mode's own scheduler, not just :class:`Scheduler`: the core builds
    it with that class's arguments and reads its outputs as that mode's (whole requests in a
    wave, or one step per tick).  Raises :class:`InvalidConfigError` (``scheduler_cls``)
    otherwise, or for an import path that does not resolve.
    """
    if value is None:
        return None
    base: type[Scheduler] = StepScheduler if step_execution else RequestScheduler
    other: type[Scheduler] = RequestScheduler if step_execution else StepScheduler
    cls = resolve_class(value, field="scheduler_cls", base=Scheduler)
    if not issubclass(cls, base):
        hint = (
            f"it is a {other.__name__} (for step_execution={not step_execution})"
            if issubclass(cls, other)
            else "it subclasses only the shared base Scheduler"
        )
        raise InvalidConfigError(
            f"scheduler_cls {cls.__module__}.{cls.__qualname__} must subclass "
            f"omni_trio.extensions.{base.__name__} in {_mode(step_execution)}, which the "
            f"engine core builds and drives; {hint}",
            field="scheduler_cls",
        )
    return cls


def _check_shape(name: str, value: Any, *, process_backend: bool) -> None:
    if value is None or isinstance(value, type):
        if process_backend and value is not None:
            portable_path(value, field=name)
        return
    if not is_import_path(value):
        raise InvalidConfigError(
            f"{name} must be a class, an import path 'package.module:Name' or None, got {value!r}",
            field=name,
        )


def check_extensions(
    *,
    scheduler_cls: Any,
    runner_cls: Any,
    worker_extension_cls: Any,
    step_execution: bool,
    backend: Any,
) -> None:
    """The checks :class:`~omni_trio.config.EngineConfig` makes of its extension fields (see
    the module docstring); :class:`InvalidConfigError` naming the field.  May import the
    scheduler's module."""
    scheduler_class(scheduler_cls, step_execution=step_execution)
    process_backend = backend in PROCESS_BACKENDS
    _check_shape("runner_cls", runner_cls, process_backend=process_backend)
    _check_shape("worker_extension_cls", worker_extension_cls, process_backend=process_backend)


def wire_extensions(data: dict[str, Any]) -> dict[str, Any]:
    """A config's fields (``data``, changed in place and returned) made fit to travel to a
    worker process: the worker-side classes as import paths, no scheduler (workers have
    none).  Raises :class:`InvalidConfigError` for a class no other process can import (a
    custom process backend meets this here, when its workers start)."""
    for name in WORKER_EXTENSION_FIELDS:
        if data.get(name) is not None:
            data[name] = portable_path(data[name], field=name)
    data["scheduler_cls"] = None
    return data
