"""A script that opens a tractor engine outside ``if __name__ == "__main__":``.

tractor 0.1.0a5 (start method ``trio``) runs the engine's main module again in every worker
process, before the worker serves: the parent sends its main module's path
(``_mp_fixup_main._mp_figure_out_main``), and the child's ``Actor.load_modules`` runs it with
``runpy`` as ``__mp_main__`` (``_fixup_main_from_path``; the fork server of
``worker_start_method="forkserver"`` does the same once).  A script whose engine code is not
under a ``__name__`` guard therefore opens an engine again inside each worker, while that
worker's tractor runtime is still booting: the nested engine tries to spawn workers of its
own and dies in ``Actor.accept_addr`` (an ``IndexError``: the booting actor has no listener
yet), or ``trio.run`` refuses to run inside the worker's own run.  The engine then saw the
worker die while starting and printed some 300 lines ending in that error.

Two checks turn it into one line that says what to add:

- :func:`check_main_guard`, before any worker is spawned: if the main module's top-level
  statement that is running now (and opens this engine) is not under a ``__name__`` check,
  raise :class:`InvalidConfigError`.  Conservative: any earlier top-level statement that
  compares ``__name__`` counts as a guard; no source, no module frame: no verdict.
- :func:`main_rerun_failure`, when a worker failed anyway: a remote error raised while the
  worker re-ran the main module becomes that :class:`InvalidConfigError` too.
"""

from __future__ import annotations

import ast
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import InvalidConfigError

__all__ = ["GUARD_HINT", "check_main_guard", "main_rerun_failure"]

GUARD_HINT = 'put the code that opens the engine under `if __name__ == "__main__":`'
# tractor's functions that re-run the parent's main module in a worker.
_RERUN_FRAMES = ("_fixup_main_from_path", "_fixup_main_from_name")


def _main_module_frame(main: Any, path: str) -> FrameType | None:
    """The frame running ``main``'s top-level code, in this thread or the main thread (the
    sync ``Engine`` opens its engine in a thread of its own)."""
    frames = sys._current_frames()
    idents = dict.fromkeys([threading.get_ident(), threading.main_thread().ident])
    target = str(Path(path).resolve())
    for ident in idents:
        frame = frames.get(ident) if ident is not None else None
        while frame is not None:
            if (
                frame.f_code.co_name == "<module>"
                and frame.f_globals is vars(main)
                and str(Path(frame.f_code.co_filename).resolve()) == target
            ):
                return frame
            frame = frame.f_back
    return None


def _compares_name(node: ast.AST) -> bool:
    """Whether ``node`` holds a check of ``__name__`` (``__name__ == "__main__"``, either
    way round, or ``match __name__``)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Compare):
            operands = [child.left, *child.comparators]
            if any(isinstance(op, ast.Name) and op.id == "__name__" for op in operands):
                return True
        if (
            isinstance(child, ast.Match)
            and isinstance(child.subject, ast.Name)
            and child.subject.id == "__name__"
        ):
            return True
    return False


def unguarded_statement() -> tuple[str, int] | None:
    """``(path, line)`` of the main module's top-level statement running now if no top-level
    statement up to it checks ``__name__``; None when guarded or when it cannot be told
    (no main file, no frame of it, no readable source)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return None
    frame = _main_module_frame(main, path)
    if frame is None:
        return None
    try:
        tree = ast.parse(Path(frame.f_code.co_filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for statement in tree.body:
        if _compares_name(statement):
            return None
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return path, statement.lineno
    return None


def check_main_guard() -> None:
    """Raise :class:`InvalidConfigError` (``field="backend"``) if this engine is being opened
    by main-module code that every tractor worker would run again (see the module doc)."""
    found = unguarded_statement()
    if found is None:
        return
    path, line = found
    raise InvalidConfigError(
        f"{path}, line {line}, opens a tractor engine outside `if __name__ == "
        '"__main__":`; every worker process runs the main module again, so it would open '
        f"engines of its own: {GUARD_HINT}",
        field="backend",
    )


def _walk(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack.extend(getattr(item, "exceptions", ()))
        stack.extend(e for e in (item.__cause__, item.__context__) if e is not None)


def main_rerun_failure(exc: BaseException) -> InvalidConfigError | None:
    """If ``exc`` (a tractor ``RemoteActorError``, or a group or chain holding one) is a
    worker failing while it ran the main module again: the one-line error to raise instead;
    else None."""
    for item in _walk(exc):
        data = getattr(item, "msgdata", None)
        if not isinstance(data, dict):
            continue
        tb = str(data.get("tb_str", ""))
        if not any(name in tb for name in _RERUN_FRAMES):
            continue
        last = tb.strip().splitlines()[-1] if tb.strip() else repr(item)
        return InvalidConfigError(
            "a worker process failed while it ran the main module again (the tractor "
            f"backend re-imports it in every worker: {last}); {GUARD_HINT}",
            field="backend",
        )
    return None
