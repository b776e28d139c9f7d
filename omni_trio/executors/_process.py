"""Waiting for an OS process of a worker to exit (tractor and Ray backends), and a process
forked by the fork server seen as a :class:`trio.Process` (stage processes)."""

from __future__ import annotations

import importlib
import os
import signal
from typing import Any

import trio

__all__ = ["ForkedProcess", "call_import_path", "wait_exited"]


async def wait_exited(pid: int) -> None:
    """Return once process ``pid`` has exited (reaped or not); at once if it is gone.

    Linux: a pidfd turns readable when the process exits.  Elsewhere: poll."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # pragma: no cover - no pidfd on this platform
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            await trio.sleep(0.05)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


def call_import_path(target: str, *args: Any) -> None:
    """Call the function at ``target`` (``"package.module:function"``) with ``args``: the
    entry of a forked process, named by path so that its caller need not import it."""
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*args)


class ForkedProcess:
    """A process forked by the fork server (a ``multiprocessing`` forkserver ``Process``),
    with the part of :class:`trio.Process`'s interface a caller that is not its parent
    needs: ``pid``, ``returncode`` (negative: killed by that signal), ``wait``, ``kill``
    and ``terminate``.  Its exit status comes from the fork server, which reaps it; a fork
    server that died first reports 255."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self._pid: int = process.pid
        self._code: int | None = None
        self._lock = trio.Lock()  # one task at a time waits on the status pipe

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the fork server reported it, else None (never blocks)."""
        if self._code is None:
            code = self._process.exitcode
            if code is not None:
                self._code = int(code)
        return self._code

    async def wait(self) -> int:
        """The exit status, once the process has exited and been reaped.  Cancelling the
        wait is harmless; several tasks may wait at once."""
        async with self._lock:
            while self.returncode is None:
                await trio.lowlevel.wait_readable(self._process.sentinel)
            self._process.close()  # its status pipe: nobody waits on it (the lock)
        assert self._code is not None
        return self._code

    def _signal(self, signum: int) -> None:
        if self.returncode is not None:
            return  # reaped: the pid may be another process's by now
        try:
            os.kill(self._pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, unless it was reaped already."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM, unless it was reaped already."""
        self._signal(signal.SIGTERM)
