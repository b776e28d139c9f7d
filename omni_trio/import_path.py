"""Import paths (``"package.module:Name"``): how a configuration names code of its own.

The extension points of :class:`~omni_trio.config.EngineConfig` (``backend``,
``scheduler_cls``, ``runner_cls``, ``worker_extension_cls`` and ``model="pkg.mod:factory"``)
take an object or the import path of one.  A path is resolved here, where it is used; an
object given directly travels to worker processes as its path (:func:`portable_path`), since
configurations cross process boundaries as plain data.

Every failure is an :class:`~omni_trio.errors.InvalidConfigError` naming the field, in one
line: the command line prints it and exits 2.  Importing this module imports nothing but the
standard library.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from .errors import InvalidConfigError

__all__ = [
    "import_path_of",
    "is_import_path",
    "portable_path",
    "resolve_class",
    "resolve_import_path",
]

# "pkg.module:Name" or "pkg.module:Outer.Inner": dotted identifiers on both sides.
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_IMPORT_PATH = re.compile(rf"(?P<module>{_DOTTED}):(?P<qualname>{_DOTTED})")


def is_import_path(value: object) -> bool:
    """Whether ``value`` is a string shaped like ``"package.module:Name"`` (nothing is
    imported)."""
    return isinstance(value, str) and _IMPORT_PATH.fullmatch(value) is not None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def resolve_import_path(path: str, *, field: str, what: str = "object") -> Any:
    """The object ``path`` (``"package.module:Name"``, ``Name`` may be dotted) names.

    Imports the module (running its top-level code once per process).  Raises
    :class:`InvalidConfigError` (``field``) for a string of another shape, a module that
    cannot be imported (any exception its import raises, in one line) or a missing name.
    """
    match = _IMPORT_PATH.fullmatch(path) if isinstance(path, str) else None
    if match is None:
        raise InvalidConfigError(
            f"{field} must be an import path 'package.module:Name' naming a {what}, got {path!r}",
            field=field,
        )
    module_name, qualname = match["module"], match["qualname"]
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code: any failure is the path's
        raise InvalidConfigError(
            f"{field} {path!r}: cannot import module {module_name!r} ({_one_line(exc)})",
            field=field,
        ) from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidConfigError(
                f"{field} {path!r}: module {module_name!r} has no {qualname!r}", field=field
            ) from None
    return obj


def resolve_class(value: Any, *, field: str, base: type, what: str | None = None) -> type:
    """``value`` (a class or an import path of one) as a class that is ``base`` or a subclass
    of it; :class:`InvalidConfigError` (``field``) otherwise, naming ``what`` (default: "a
    subclass of ``base``")."""
    what = what or f"a subclass of {base.__module__}.{base.__qualname__}"
    cls = resolve_import_path(value, field=field, what=what) if isinstance(value, str) else value
    if not (isinstance(cls, type) and issubclass(cls, base)):
        shown = value if isinstance(value, str) else _describe(value)
        raise InvalidConfigError(f"{field} must be {what}, got {shown!r}", field=field)
    return cls


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    return repr(value)


def import_path_of(obj: Any) -> str:
    """``"module:qualname"`` of a class or function (no check that it resolves back; see
    :func:`portable_path`)."""
    return f"{obj.__module__}:{obj.__qualname__}"


def portable_path(value: Any, *, field: str) -> str:
    """``value`` as an import path another process can resolve: a string is returned as it
    is (its shape checked); a class or function becomes ``"module:qualname"``.

    Raises :class:`InvalidConfigError` (``field``) for an object no other process can import
    by name: one defined inside a function (``<locals>``), in ``__main__`` (a script's own
    module: a worker process does not import it under that name), or whose path does not
    lead back to the very object (replaced or generated at run time).  Resolving a class's
    path imports nothing new: its module is already imported here.
    """
    if isinstance(value, str):
        if not is_import_path(value):
            raise InvalidConfigError(
                f"{field} must be an import path 'package.module:Name', got {value!r}",
                field=field,
            )
        return value
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise InvalidConfigError(
            f"{field} must be a class or an import path 'package.module:Name', got {value!r}",
            field=field,
        )
    name = f"{module}.{qualname}"
    move = "define it at the top level of an importable module and pass 'package.module:Name'"
    if "<locals>" in qualname:
        raise InvalidConfigError(
            f"{field} {name} is defined inside a function, so worker processes cannot import "
            f"it: {move}",
            field=field,
        )
    if module == "__main__":
        raise InvalidConfigError(
            f"{field} {qualname} is defined in __main__ (the script being run), which worker "
            f"processes do not import under that name: {move}",
            field=field,
        )
    path = import_path_of(value)
    try:
        found = resolve_import_path(path, field=field)
    except InvalidConfigError:
        found = None
    if found is not value:
        raise InvalidConfigError(
            f"{field} {name} cannot be imported back by its path {path!r} (replaced or made "
            f"at run time), so worker processes cannot load it: {move}",
            field=field,
        )
    return path
