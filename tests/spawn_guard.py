"""Every test that starts a process is marked ``slow``, so ``make test-fast`` starts none.

:func:`install` wraps the process-starting primitives of this interpreter once: ``subprocess``
(``Popen``, hence ``trio.lowlevel.open_process``, tractor and Ray), ``multiprocessing``'s
spawn and fork servers (``_posixsubprocess.fork_exec``) and ``os.fork`` / ``os.posix_spawn``.
While a test runs, :class:`SpawnWatch` records what they start; the autouse fixture
:func:`spawns_are_marked_slow` (imported by ``tests/conftest.py`` and
``property_tests/conftest.py``) fails a test that started a process unless its whole module
is marked ``slow`` (``pytestmark = pytest.mark.slow``).
"""

from __future__ import annotations

import _posixsubprocess
import functools
import os
import platform
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

__all__ = [
    "SPAWN_MESSAGE",
    "SpawnWatch",
    "install",
    "module_marked_slow",
    "spawns_are_marked_slow",
    "unmarked_spawn",
    "watch",
]

SPAWN_MESSAGE = (
    "{nodeid} started a process ({what}) but its module is not marked slow: `make test-fast` "
    "must start none. Mark the module: `pytestmark = pytest.mark.slow`."
)


class SpawnWatch:
    """What the wrapped primitives started while :attr:`active` (one test's run)."""

    def __init__(self) -> None:
        self.active = False
        self.started: list[str] = []

    def record(self, what: str) -> None:
        if self.active:
            self.started.append(what)


_WATCH = SpawnWatch()


def _wrap(owner: Any, name: str, describe: Callable[..., str]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_omni_spawn_guard", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _WATCH.record(describe(*args, **kwargs))
        return original(*args, **kwargs)

    wrapper._omni_spawn_guard = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _first_arg(label: str) -> Callable[..., str]:
    def describe(*args: Any, **kwargs: Any) -> str:
        return f"{label} {args[0]!r}" if args else label

    return describe


def _popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> str:
    return f"subprocess {args!r}"


def install() -> SpawnWatch:
    """Wrap the primitives (idempotent) and return the watch the conftests read.

    ``platform.processor()`` runs ``uname -p`` once per interpreter and caches it: asked here,
    first, so no test (``omni_trio.bench.harness.machine_info``) starts that process.
    """
    platform.processor()
    _wrap(subprocess.Popen, "_execute_child", _popen)
    _wrap(_posixsubprocess, "fork_exec", _first_arg("fork_exec"))
    _wrap(os, "fork", _first_arg("os.fork"))
    _wrap(os, "posix_spawn", _first_arg("os.posix_spawn"))
    _wrap(os, "posix_spawnp", _first_arg("os.posix_spawnp"))
    return _WATCH


@contextmanager
def watch() -> Iterator[SpawnWatch]:
    """Record the processes started inside the block (one test's setup, call, teardown)."""
    _WATCH.started = []
    _WATCH.active = True
    try:
        yield _WATCH
    finally:
        _WATCH.active = False


def module_marked_slow(module: Any) -> bool:
    """Whether ``module`` carries ``pytestmark = pytest.mark.slow`` (alone or in a list)."""
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list | tuple) else [marks]
    return any(getattr(mark, "name", None) == "slow" for mark in marks)


def unmarked_spawn(node: Any, started: list[str]) -> str | None:
    """Why test ``node`` fails the rule (it started a process and its module is not marked
    slow), or None."""
    if not started or module_marked_slow(getattr(node, "module", None)):
        return None
    return SPAWN_MESSAGE.format(nodeid=node.nodeid, what=started[0])


@pytest.fixture(autouse=True)
def spawns_are_marked_slow(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test (at teardown) if it started a process and its module is not marked
    ``slow``."""
    with watch() as spawns:
        yield
    problem = unmarked_spawn(request.node, spawns.started)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


install()
