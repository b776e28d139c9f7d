"""tests/spawn_guard.py sees every way a test can start a process, and fails a test that does
without the ``slow`` marker (so ``make test-fast`` starts none)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from typing import Any

import pytest

from tests import spawn_guard

pytestmark = pytest.mark.slow  # starts processes, on purpose


class _Module:
    def __init__(self, pytestmark: Any) -> None:
        if pytestmark is not None:
            self.pytestmark = pytestmark


class _Node:
    """The two things :func:`spawn_guard.unmarked_spawn` reads of a pytest item."""

    def __init__(self, pytestmark: Any = None) -> None:
        self.nodeid = "tests/test_x.py::test_y"
        self.module = _Module(pytestmark)


def _exit_at_once() -> None:
    pass


def test_every_way_of_starting_a_process_is_seen() -> None:
    true = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
    with spawn_guard.watch() as spawns:
        subprocess.run([true], check=True)
        os.waitpid(os.posix_spawn(true, [true], os.environ), 0)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0)
        os.waitpid(pid, 0)
        process = multiprocessing.get_context("spawn").Process(target=_exit_at_once)
        process.start()
        process.join()
    kinds = [what.split(" ", 1)[0] for what in spawns.started]
    assert kinds[:3] == ["subprocess", "os.posix_spawn", "os.fork"]
    assert "fork_exec" in kinds[3:]  # multiprocessing's spawn
    with spawn_guard.watch() as nothing:
        sorted(range(3))
    assert nothing.started == []


def test_a_test_that_starts_a_process_must_be_in_a_module_marked_slow() -> None:
    started = [f"subprocess [{sys.executable!r}]"]
    problem = spawn_guard.unmarked_spawn(_Node(), started)
    assert problem is not None
    assert "tests/test_x.py::test_y started a process (subprocess" in problem
    assert "pytestmark = pytest.mark.slow" in problem
    assert spawn_guard.unmarked_spawn(_Node(pytest.mark.slow), started) is None
    assert spawn_guard.unmarked_spawn(_Node([pytest.mark.trio, pytest.mark.slow]), started) is None
    assert spawn_guard.unmarked_spawn(_Node(pytest.mark.trio), started) is not None
    assert spawn_guard.unmarked_spawn(_Node(), []) is None  # started nothing: fine


def test_this_module_is_marked() -> None:
    assert spawn_guard.module_marked_slow(sys.modules[__name__])


def test_the_guard_is_installed_for_the_whole_session() -> None:
    assert getattr(subprocess.Popen._execute_child, "_omni_spawn_guard", False)
    assert getattr(os.fork, "_omni_spawn_guard", False)
