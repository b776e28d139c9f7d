"""How an ``omni-trio`` command ends: exit codes, one-line errors, and the wrapper that turns
expected failures into them (a bug still shows its traceback)."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "CliError",
    "classify",
    "fail",
    "run_command",
    "walk_exceptions",
    "warn",
]

PROG = "omni-trio"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """An expected failure: printed as one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def walk_exceptions(exc: BaseException, *, contexts: bool = False) -> list[BaseException]:
    """``exc``, the members of exception groups inside it and its cause chain (and, with
    ``contexts``, the exceptions it was raised while handling), depth first."""
    seen: set[int] = set()
    order: list[BaseException] = []
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        order.append(current)
        children: list[BaseException] = []
        if isinstance(current, BaseExceptionGroup):
            children.extend(current.exceptions)
        if current.__cause__ is not None:
            children.append(current.__cause__)
        if contexts and current.__context__ is not None:
            children.append(current.__context__)
        stack.extend(reversed(children))
    return order


def classify(exc: BaseException) -> CliError | None:
    """Map an expected failure to a :class:`CliError`; None for anything else (a bug)."""
    from .errors import InvalidConfigError, InvalidRequestError, OmniTrioError

    found = walk_exceptions(exc)
    for item in found:
        if isinstance(item, CliError):
            return item
    for item in found:
        if isinstance(item, InvalidRequestError | InvalidConfigError):
            return CliError(str(item), EXIT_USAGE)
    for item in found:
        if isinstance(item, OmniTrioError):
            return CliError(str(item), EXIT_FAILED)
    if isinstance(exc, OSError):
        return CliError(str(exc), EXIT_FAILED)
    if isinstance(exc, RuntimeError) and str(exc).startswith("engine warmup failed"):
        return CliError(str(exc), EXIT_FAILED)
    return None


def fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def run_command(fn: Callable[[], int]) -> int:
    """Run a command body, turning expected failures into one-line errors."""
    try:
        return fn()
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        error = classify(exc)
        if error is None:
            raise
        return fail(str(error), error.code)
