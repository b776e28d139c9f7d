"""A process forked by the fork server, seen as a trio.Process (``ForkedProcess``), and the
entry that names its function by path.  Real processes forked from the tests' fork server."""

from __future__ import annotations

import os
import signal
import time

import pytest
import trio
import trio.testing

from omni_trio.executors._process import ForkedProcess, call_import_path, wait_exited
from omni_trio.executors.tractor_executor import start_forked

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 60.0


async def fork(target: str, *args: object) -> ForkedProcess:
    return await trio.to_thread.run_sync(
        lambda: start_forked(target, args, name="omni-trio-test-forked")
    )


async def test_a_killed_process_reports_the_signal_to_every_waiter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with trio.fail_after(CAP_S):
        process = await fork("time:sleep", 60.0)
        assert process.returncode is None
        codes: list[int] = []
        async with trio.open_nursery() as nursery:
            for _ in range(3):  # several tasks wait on the one status pipe
                nursery.start_soon(lambda: _append(codes, process))
            await trio.testing.wait_all_tasks_blocked()
            process.kill()
        assert codes == [-signal.SIGKILL] * 3
        assert process.returncode == -signal.SIGKILL
        signalled: list[tuple[int, int]] = []
        monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
        process.kill()  # ended: nothing is signalled (the pid may be another's now)
        process.terminate()
        assert signalled == []
        assert await process.wait() == -signal.SIGKILL


async def _append(codes: list[int], process: ForkedProcess) -> None:
    codes.append(await process.wait())


async def test_an_exit_status_and_a_terminate_come_through() -> None:
    with trio.fail_after(CAP_S):
        done = await fork("os:_exit", 3)
        assert await done.wait() == 3
        sleeper = await fork("time:sleep", 60.0)
        with trio.move_on_after(0.05):
            await sleeper.wait()  # a cancelled wait leaves the next one working
        sleeper.terminate()
        assert await sleeper.wait() == -signal.SIGTERM


async def test_wait_exited_returns_once_a_process_it_does_not_own_ended() -> None:
    with trio.fail_after(CAP_S):
        process = await fork("time:sleep", 60.0)
        began = time.monotonic()
        os.kill(process.pid, signal.SIGKILL)
        await wait_exited(process.pid)
        assert time.monotonic() - began < CAP_S
        await process.wait()
        await wait_exited(process.pid)  # gone: at once


async def test_forking_leaves_tractors_start_method_and_exit_alone() -> None:
    """A fork is not tractor's spawn: its start method stays what the application's runtime
    chose; and the process is not multiprocessing's to join when this interpreter exits
    (its owner ends it)."""
    import multiprocessing

    from tractor import _spawn

    before = _spawn._spawn_method
    with trio.fail_after(CAP_S):
        process = await fork("time:sleep", 60.0)
        assert _spawn._spawn_method == before
        assert process.pid not in {child.pid for child in multiprocessing.active_children()}
        process.kill()
        assert await process.wait() == -signal.SIGKILL


def test_call_import_path_calls_the_named_function() -> None:
    seen: list[object] = []
    call_import_path("tests.executors.test_process:_record", seen, 1, 2)
    assert seen == [(1, 2)]


def _record(into: list[object], *args: object) -> None:
    into.append(args)
